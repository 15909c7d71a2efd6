//! Shared by nibble-quant's integration tests: the tiny fixture models as dense f32 models, their
//! logits on a fixed prompt, and a relative closeness check.
// Each test binary compiles this module and uses a different part of it.
#![allow(dead_code)]

use std::path::PathBuf;

use nibble_cpu::CpuBackend;
use nibble_model::{BatchLayout, LogitRows, Transformer, open_model};
use nibble_quant::dense::DenseModel;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../nibble-model/tests/fixtures")
        .join(name)
}

pub fn dense(name: &str) -> DenseModel {
    let files = open_model(&fixture(name), None).unwrap();
    DenseModel::load(files.config.clone(), &*files.source, &mut |_, _| {}).unwrap()
}

pub const TOKENS: [u32; 12] = [1, 5, 9, 17, 33, 2, 64, 100, 7, 3, 11, 42];

/// Logits of the plain CPU forward pass over [`TOKENS`].
pub fn logits(model: &DenseModel) -> Vec<f32> {
    let backend = CpuBackend::new(1).unwrap();
    let t = Transformer::load(&backend, model.config.clone(), model, &mut |_, _| {}).unwrap();
    let (mut kv, table) = t.single_sequence_kv(&backend, TOKENS.len()).unwrap();
    t.forward(
        &backend,
        &TOKENS,
        &BatchLayout::single(table, 0, TOKENS.len()),
        &mut kv,
        LogitRows::All,
    )
    .unwrap()
    .data
}

/// Max absolute difference within `tol` times the largest magnitude of `a`; NaN never passes.
pub fn assert_close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
    let err = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        err.is_finite() && err <= tol * scale,
        "{what}: max error {err} (scale {scale})"
    );
}
