//! Loading a cubin into the context and finding its entry points.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use nibble_core::{Error, Result};

use crate::runtime::{Gpu, Kernel, driver_err};

/// Loads `cubin` and adds every `extern "C"` kernel it defines to `kernels`.
pub fn load(
    gpu: &Arc<Gpu>,
    name: &str,
    cubin: &[u8],
    kernels: &mut HashMap<&'static str, Kernel>,
) -> Result<()> {
    gpu.bind()?;
    let module = unsafe { cu::module::load_data(cubin.as_ptr() as *const _) }
        .map_err(|e| driver_err(&format!("loading kernels '{name}'"), e))?;
    // Modules live as long as the process: kernels are few and shared by every backend on a GPU.
    for entry in entry_points(cubin) {
        let cname = std::ffi::CString::new(entry.as_str()).expect("symbol names hold no NUL");
        let func: sys::CUfunction = unsafe { cu::module::get_function(module, cname) }
            .map_err(|e| driver_err(&format!("kernel {entry}"), e))?;
        let leaked: &'static str = Box::leak(entry.into_boxed_str());
        kernels.insert(leaked, Kernel { func, name: leaked });
    }
    if kernels.is_empty() {
        return Err(Error::unsupported(
            "CUDA kernels",
            format!("module '{name}' has no kernels"),
        ));
    }
    Ok(())
}

/// Names of the kernels a cubin defines, read from its ELF symbol table: every global function
/// symbol whose name has no C++ mangling (`extern "C"` entry points).
pub fn entry_points(cubin: &[u8]) -> Vec<String> {
    // The cubin is an ELF64 file; kernels are STT_FUNC symbols in sections named ".text.<name>".
    let mut out = Vec::new();
    let rd16 = |o: usize| u16::from_le_bytes([cubin[o], cubin[o + 1]]) as usize;
    let rd32 = |o: usize| u32::from_le_bytes(cubin[o..o + 4].try_into().unwrap()) as usize;
    let rd64 = |o: usize| u64::from_le_bytes(cubin[o..o + 8].try_into().unwrap()) as usize;
    if cubin.len() < 64 || &cubin[..4] != b"\x7fELF" {
        return out;
    }
    let (shoff, shentsize, shnum, shstrndx) = (rd64(0x28), rd16(0x3a), rd16(0x3c), rd16(0x3e));
    let section = |i: usize| shoff + i * shentsize;
    let name_at = |tab: usize, off: usize| -> String {
        let start = tab + off;
        let end = cubin[start..]
            .iter()
            .position(|&b| b == 0)
            .map_or(cubin.len(), |p| start + p);
        String::from_utf8_lossy(&cubin[start..end]).into_owned()
    };
    let shstr = rd64(section(shstrndx) + 0x18);
    for i in 0..shnum {
        let sh = section(i);
        let name = name_at(shstr, rd32(sh));
        if let Some(kernel) = name.strip_prefix(".text.")
            && !kernel.starts_with("_Z")
        {
            out.push(kernel.to_string());
        }
    }
    out
}
