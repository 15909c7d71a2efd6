//! Page-locked host memory and events: what lets the host queue a step and go on. A copy from
//! ordinary (pageable) memory may make the driver wait for the stream before it stages the
//! bytes, and a copy back into it always waits; from and into page-locked memory both are queued
//! like kernels. Uploads of per-step data go through a [`StagingRing`], results come back into
//! page-locked slots read once their event has fired.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use nibble_core::Result;

use crate::runtime::{DevicePtr, Gpu, driver_err};

/// Page-locked host memory.
pub struct PinnedBuffer {
    ptr: *mut u8,
    pub bytes: usize,
    gpu: Arc<Gpu>,
}

// The buffer is plain memory owned by this value; the raw pointer is only why it is not
// automatically Send/Sync.
unsafe impl Send for PinnedBuffer {}
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    pub fn alloc(gpu: &Arc<Gpu>, bytes: usize) -> Result<PinnedBuffer> {
        gpu.bind()?;
        let ptr = unsafe { cu::malloc_host(bytes.max(64), 0) }
            .map_err(|e| driver_err("page-locked host allocation", e))?;
        Ok(PinnedBuffer {
            ptr: ptr as *mut u8,
            bytes,
            gpu: gpu.clone(),
        })
    }

    /// `n` values of `T` at byte `offset`, for reading results the device copied there.
    ///
    /// # Safety
    /// The device must have finished writing them (the copy's event has fired), and `T` must be
    /// plain data for any bit pattern.
    pub unsafe fn read<T: Copy>(&self, offset: usize, n: usize) -> &[T] {
        assert!(
            offset + n * size_of::<T>() <= self.bytes && offset.is_multiple_of(align_of::<T>())
        );
        unsafe { std::slice::from_raw_parts(self.ptr.add(offset) as *const T, n) }
    }

    fn write<T: Copy>(&mut self, offset: usize, src: &[T]) {
        let bytes = size_of_val(src);
        assert!(offset + bytes <= self.bytes);
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr() as *const u8, self.ptr.add(offset), bytes)
        };
    }

    fn addr(&self, offset: usize) -> *mut c_void {
        unsafe { self.ptr.add(offset) as *mut c_void }
    }

    /// The start of the buffer, for the device to copy into.
    pub fn addr_mut(&mut self) -> *mut c_void {
        self.ptr as *mut c_void
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        let _ = unsafe { cu::free_host(self.ptr as *mut c_void) };
    }
}

/// A CUDA event without timing: marks a point in the stream the host can wait for.
pub struct Event(sys::CUevent, Arc<crate::runtime::WaitGauge>);

unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    /// An event that keeps the time it fired, for [`Event::seconds_since`].
    pub fn timed(gpu: &Gpu) -> Result<Event> {
        Event::create(gpu, sys::CUevent_flags::CU_EVENT_DEFAULT)
    }

    /// Seconds from `earlier` to this event, both timed and both fired.
    pub fn seconds_since(&self, earlier: &Event) -> Result<f64> {
        unsafe { cu::event::elapsed(earlier.0, self.0) }
            .map(|ms| f64::from(ms) / 1e3)
            .map_err(|e| driver_err("event elapsed time", e))
    }

    pub fn new(gpu: &Gpu) -> Result<Event> {
        Event::create(gpu, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
    }

    fn create(gpu: &Gpu, flags: sys::CUevent_flags) -> Result<Event> {
        gpu.bind()?;
        cu::event::create(flags)
            .map(|raw| Event(raw, gpu.waits.clone()))
            .map_err(|e| driver_err("event create", e))
    }

    /// Marks the work queued on `gpu`'s stream so far.
    pub fn record(&self, gpu: &Gpu) -> Result<()> {
        unsafe { cu::event::record(self.0, gpu.cu_stream()) }
            .map_err(|e| driver_err("event record", e))
    }

    /// Waits until the marked work has finished.
    pub fn wait(&self) -> Result<()> {
        self.1
            .during(|| unsafe { cu::event::synchronize(self.0) })
            .map_err(|e| driver_err("event wait (an earlier kernel failed)", e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _ = unsafe { cu::event::destroy(self.0) };
    }
}

/// Copies `bytes` from page-locked `src` to the device, queued on the stream.
///
/// # Safety
/// `src` must stay valid and unchanged until the copy has run.
unsafe fn copy_to_device(
    gpu: &Gpu,
    dst: DevicePtr,
    src: *const c_void,
    bytes: usize,
) -> Result<()> {
    unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src, bytes, gpu.cu_stream()) }
        .result()
        .map_err(|e| driver_err("copy to device", e))
}

/// Copies `bytes` from the device into page-locked `dst`, queued on the stream.
///
/// # Safety
/// `dst` must stay valid, and unread, until the copy has run.
pub unsafe fn copy_to_host(
    gpu: &Gpu,
    dst: *mut c_void,
    src: DevicePtr,
    bytes: usize,
) -> Result<()> {
    unsafe { sys::cuMemcpyDtoHAsync_v2(dst, src, bytes, gpu.cu_stream()) }
        .result()
        .map_err(|e| driver_err("copy to host", e))
}

/// Uploads of per-step data (batch metadata, sampling rows) through a ring of page-locked
/// memory: each upload takes the next stretch of the ring, and a stretch is written again only
/// once the copy that last read it has run (its event), so the host never waits for the stream
/// unless it is a whole ring ahead.
pub struct StagingRing {
    buf: Option<PinnedBuffer>,
    head: usize,
    /// Stretches still to be copied, oldest first: (start, end, event after the copy).
    queued: VecDeque<(usize, usize, Event)>,
    spare: Vec<Event>,
}

impl Default for StagingRing {
    fn default() -> Self {
        StagingRing::new()
    }
}

impl StagingRing {
    /// Ring bytes to begin with: a few steps of metadata at 1024 sequences.
    const INITIAL: usize = 8 << 20;
    const ALIGN: usize = 256;

    pub const fn new() -> StagingRing {
        StagingRing {
            buf: None,
            head: 0,
            queued: VecDeque::new(),
            spare: Vec::new(),
        }
    }

    /// Queues a copy of `src` to `dst` on `gpu`'s stream; returns without waiting for it.
    pub fn upload<T: Copy>(&mut self, gpu: &Arc<Gpu>, dst: DevicePtr, src: &[T]) -> Result<()> {
        let bytes = size_of_val(src);
        if bytes == 0 {
            return Ok(());
        }
        let span = bytes.div_ceil(Self::ALIGN) * Self::ALIGN;
        if self.buf.as_ref().is_none_or(|b| b.bytes < span) {
            // Copies may still read the old ring.
            gpu.synchronize()?;
            self.recycle_all();
            self.buf = None;
            self.buf = Some(PinnedBuffer::alloc(gpu, span.max(Self::INITIAL))?);
            self.head = 0;
        }
        let len = self.buf.as_ref().map_or(0, |b| b.bytes);
        if self.head + span > len {
            self.head = 0;
        }
        let (start, end) = (self.head, self.head + span);
        // Copies run in the order they were queued: once the newest one that read this stretch
        // has run, so has every copy before it.
        if let Some(last) = self
            .queued
            .iter()
            .rposition(|&(s, e, _)| s < end && e > start)
        {
            self.queued[last].2.wait()?;
            let done: Vec<_> = self.queued.drain(..=last).map(|(_, _, ev)| ev).collect();
            self.spare.extend(done);
        }
        let buf = self.buf.as_mut().expect("allocated above");
        buf.write(start, src);
        unsafe { copy_to_device(gpu, dst, buf.addr(start), bytes)? };
        let ev = match self.spare.pop() {
            Some(e) => e,
            None => Event::new(gpu)?,
        };
        ev.record(gpu)?;
        self.queued.push_back((start, end, ev));
        self.head = end;
        Ok(())
    }

    fn recycle_all(&mut self) {
        self.spare
            .extend(self.queued.drain(..).map(|(_, _, ev)| ev));
    }
}
