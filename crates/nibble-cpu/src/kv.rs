//! Contiguous per-sequence KV storage: for each slot and layer, keys and values as
//! `[position][kv_head][head_dim]` f32, grown as the sequence grows.

use nibble_core::{Error, Result};
use nibble_model::{KvCache, KvShape};

pub struct SeqKv {
    pub len: usize,
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
}

pub struct CpuKvCache {
    pub shape: KvShape,
    seqs: Vec<Option<SeqKv>>,
}

impl CpuKvCache {
    pub fn new(shape: KvShape, max_seqs: usize) -> Self {
        CpuKvCache {
            shape,
            seqs: (0..max_seqs).map(|_| None).collect(),
        }
    }

    pub(crate) fn seq_mut(&mut self, slot: usize) -> Result<&mut SeqKv> {
        self.seqs
            .get_mut(slot)
            .and_then(Option::as_mut)
            .ok_or_else(|| Error::InvalidArgument(format!("KV slot {slot} is not allocated")))
    }
}

impl KvCache for CpuKvCache {
    fn alloc_seq(&mut self) -> Result<usize> {
        let slot =
            self.seqs
                .iter()
                .position(Option::is_none)
                .ok_or_else(|| Error::LimitExceeded {
                    what: "concurrent sequences in the KV cache".into(),
                    value: self.seqs.len() + 1,
                    limit: self.seqs.len(),
                })?;
        let layers = self.shape.num_layers;
        self.seqs[slot] = Some(SeqKv {
            len: 0,
            k: vec![Vec::new(); layers],
            v: vec![Vec::new(); layers],
        });
        Ok(slot)
    }

    fn free_seq(&mut self, slot: usize) {
        if let Some(s) = self.seqs.get_mut(slot) {
            *s = None;
        }
    }

    fn seq_len(&self, slot: usize) -> usize {
        self.seqs
            .get(slot)
            .and_then(Option::as_ref)
            .map_or(0, |s| s.len)
    }

    fn truncate(&mut self, slot: usize, len: usize) {
        let row = self.shape.num_kv_heads * self.shape.head_dim;
        if let Some(Some(s)) = self.seqs.get_mut(slot) {
            s.len = s.len.min(len);
            for l in s.k.iter_mut().chain(s.v.iter_mut()) {
                l.truncate(s.len * row);
            }
        }
    }
}
