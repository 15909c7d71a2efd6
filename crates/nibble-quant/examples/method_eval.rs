//! Simulated perplexity of quantization methods on a real model: each method quantizes the model
//! on ShareGPT's calibration half, and the result runs in [`Simulated`] (decoded weights,
//! run-time activation quantization, float KV) over ShareGPT's evaluation half.
//!
//! ```text
//! cargo run --release -p nibble-quant --example method_eval -- MODEL CALIB EVAL LEN METHOD:SPEC...
//! e.g. ... -- ~/.cache/nibble/models/SmolLM2-135M-Instruct.Q4_1.gguf 32 16 256 rtn:w4a8 qoq:w4a8
//! ```
//!
//! Ablations: `qoq-noclip-noreorder:w4a8-g64` leaves steps out of QoQ (`norotate`,
//! `norotatevalues` / `rotatevalues`, `nosmoothattn`, `nosmoothout`, `noreorder`, `noclip`; SmoothAttention's
//! strength: `sa0.5` fixed, `sappl` by calibration perplexity, `saerr` by key error per layer;
//! `norotatepairs`; `aseqN` keeps N sequences' attention inputs; `shrinkN` the level-1 step
//! search's largest shrink, 0 for none);
//! `NIBBLE_DEV=1` evaluates on unused calibration-half sequences instead of the evaluation half.
//! `fmpq@4:w4a4a8-g64` sets FMPQ's outlier threshold.
//! `NIBBLE_ATTR=1` says where a quantized model's loss comes from: its perplexity with the
//! weights alone quantized, the activations alone, each input site's layers left in float, and
//! the down_proj layers' relative output error per layer.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, bail};
use nibble_model::open_model;
use nibble_precision::{ActQuant, PrecisionSpec};
use nibble_quant::data::{Split, sharegpt_sequences};
use nibble_quant::dense::{DenseModel, SiteKind};
use nibble_quant::qoq::QoqSteps;
use nibble_quant::simulate::Simulated;
use nibble_quant::{Method, QuantOptions, quantize};
use nibble_quant::{fmpq, qoq};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 5 {
        bail!("usage: method_eval MODEL CALIB_SEQS EVAL_SEQS LEN METHOD:SPEC...");
    }
    let n = |i: usize| -> anyhow::Result<usize> {
        args[i]
            .parse()
            .with_context(|| format!("'{}' is not a count", args[i]))
    };
    let (n_cal, n_eval, len) = (n(1)?, n(2)?, n(3)?);
    let files = open_model(Path::new(&args[0]), None)?;
    let model = DenseModel::load(files.config.clone(), &*files.source, &mut |_, _| {})?;
    // NIBBLE_DEV=1: evaluate on calibration-half sequences the calibration does not use (a dev
    // set for choosing between variants without looking at the held-out half).
    let (calib, eval) = if std::env::var("NIBBLE_DEV").is_ok_and(|v| v == "1") {
        let mut all = sharegpt_sequences(
            None,
            &files.tokenizer,
            Split::Calibration,
            n_cal + n_eval,
            len,
        )?;
        let eval = all.split_off(n_cal);
        (all, eval)
    } else {
        (
            sharegpt_sequences(None, &files.tokenizer, Split::Calibration, n_cal, len)?,
            sharegpt_sequences(None, &files.tokenizer, Split::Evaluation, n_eval, len)?,
        )
    };
    let opts = QuantOptions::default();
    let t = Instant::now();
    let (nll, count) = Simulated::float(&model).mean_nll(&eval, 0, &mut |_, _| {})?;
    println!(
        "float: ppl {:.3} over {count} tokens ({:.0}s)",
        nll.exp(),
        t.elapsed().as_secs_f64()
    );
    for job in &args[4..] {
        let (m, s) = job
            .split_once(':')
            .with_context(|| format!("'{job}' is not METHOD:SPEC"))?;
        let spec: PrecisionSpec = s.parse()?;
        let t = Instant::now();
        let mut last = String::new();
        let mut progress = |stage: &str, d: usize, total: usize| {
            if stage != last || d == total {
                eprintln!(
                    "  {job}: {stage} {d}/{total} ({:.0}s)",
                    t.elapsed().as_secs_f64()
                );
                last = stage.to_string();
            }
        };
        // Ablations: `qoq-no<step>...` leaves QoQ steps out, `fmpq@R` sets FMPQ's threshold.
        let q = if let Some(off) = m.strip_prefix("qoq-") {
            let mut steps = QoqSteps::default();
            for step in off.split('-') {
                match step {
                    "norotate" => steps.rotate = false,
                    "norotatevalues" => steps.rotate_values = false,
                    "rotatevalues" => steps.rotate_values = true,
                    "nosmoothattn" => steps.smooth_attention = false,
                    "nosmoothout" => steps.smooth_outputs = false,
                    "noreorder" => steps.reorder = false,
                    "noclip" => steps.clip = false,
                    "norotatepairs" => steps.rotate_key_pairs = false,
                    s if s.starts_with("shrink") => {
                        steps.level1_shrinks = s[6..]
                            .parse()
                            .with_context(|| format!("bad level-1 shrink '{s}'"))?
                    }
                    "sappl" => steps.attention_strength = qoq::AttentionStrength::Perplexity,
                    "saerr" => steps.attention_strength = qoq::AttentionStrength::KeyError,
                    s if s.starts_with("aseq") => {
                        steps.attention_sequences = s[4..]
                            .parse()
                            .with_context(|| format!("bad sequence count '{s}'"))?
                    }
                    s if s.starts_with("sa") => {
                        let v: f32 = s[2..]
                            .parse()
                            .with_context(|| format!("bad SmoothAttention strength '{s}'"))?;
                        steps.attention_strength = qoq::AttentionStrength::Fixed(v)
                    }
                    _ => bail!("unknown QoQ ablation '{step}'"),
                }
            }
            qoq::quantize_with(model.clone(), spec, &calib, &opts, steps, &mut progress)?
        } else if let Some(v) = m.strip_prefix("sq@") {
            // `sq@GAIN[@noglobal][@first][@scales][@clips][@nosmooth]`: SmoothQuant's per-site
            // confirmation margin, whether the global strengths compete, whether the searches see
            // every first token, the FP8 weight scale search, a weight clip search (1.0 down to
            // 0.70 per row), no smoothing at all.
            let mut parts = v.split('@');
            let gain: f64 = parts
                .next()
                .unwrap_or("0")
                .parse()
                .with_context(|| format!("bad gain in '{m}'"))?;
            let mut o = nibble_quant::smoothquant::SmoothQuantOptions {
                min_gain: gain,
                ..Default::default()
            };
            let rest: Vec<&str> = parts.collect();
            if rest.contains(&"noglobal") {
                o.global_alphas.clear();
            }
            if rest.contains(&"scales") {
                o.weight_ratios = nibble_quant::smoothquant::fp8_scale_ratios();
            }
            if rest.contains(&"clips") {
                o.weight_ratios = nibble_quant::sim::clip_grid();
            }
            if rest.contains(&"nosmooth") {
                o.alphas.clear();
            }
            let calib_stats = nibble_quant::search::calibrate_with_first(
                &model,
                &calib,
                nibble_quant::search::SEARCH_ROWS,
                false,
                rest.contains(&"first"),
                0,
                &mut progress,
            )?;
            nibble_quant::smoothquant::smoothquant(
                model.clone(),
                spec,
                calib_stats,
                &calib,
                0,
                &o,
                &mut progress,
            )?
        } else if let Some(r) = m.strip_prefix("fmpq@") {
            let ratio: f32 = r.parse().with_context(|| format!("bad ratio '{r}'"))?;
            fmpq::quantize_with(model.clone(), spec, &calib, &opts, ratio, &mut progress)?
        } else {
            let method: Method = m.parse()?;
            quantize(model.clone(), spec, method, &calib, &opts, &mut progress)?
        };
        let quant_s = t.elapsed().as_secs_f64();
        let (nll, _) = Simulated::new(&q)?.mean_nll(&eval, 0, &mut |_, _| {})?;
        println!("{job}: ppl {:.3} (quantized in {quant_s:.0}s)", nll.exp());
        if std::env::var("NIBBLE_ATTR").is_ok_and(|v| v == "1") {
            attribute(&q, &eval)?;
        }
        // COMET: the share of activation channels each site kind keeps at INT8.
        let mut share: BTreeMap<SiteKind, (usize, usize)> = BTreeMap::new();
        for (id, (f, _)) in &q.linears {
            if let ActQuant::Mixed4x8 { block, int8_blocks } = f.act {
                let e = share.entry(id.kind.site()).or_default();
                e.0 += block as usize * int8_blocks as usize;
                e.1 += q.dense.linear(*id).cols;
            }
        }
        let (mut a, mut b) = (0, 0);
        for (site, (i8c, all)) in &share {
            println!(
                "  {site:?}: {:.1}% of channels INT8",
                100.0 * *i8c as f64 / *all as f64
            );
            a += i8c;
            b += all;
        }
        if b > 0 {
            println!("  all linears: {:.1}% INT8", 100.0 * a as f64 / b as f64);
        }
    }
    Ok(())
}

/// Perplexity of `q` with parts of it back in float (see `NIBBLE_ATTR` in the module docs).
fn attribute(q: &nibble_quant::QuantizedModel, eval: &[Vec<u32>]) -> anyhow::Result<()> {
    use nibble_quant::sim::ActSim;
    let ppl =
        |s: &Simulated| -> anyhow::Result<f64> { Ok(s.mean_nll(eval, 0, &mut |_, _| {})?.0.exp()) };
    let full = Simulated::new(q)?;
    let mut weights_only = full.clone();
    weights_only
        .acts
        .values_mut()
        .for_each(|a| *a = ActSim::Float);
    let acts_only = Simulated {
        dense: q.dense.clone(),
        ..full.clone()
    };
    println!("  weights only: ppl {:.3}", ppl(&weights_only)?);
    println!("  activations only: ppl {:.3}", ppl(&acts_only)?);
    for site in SiteKind::ALL {
        let mut part = q.clone();
        part.linears.retain(|id, _| id.kind.site() != site);
        println!(
            "  {site:?} in float: ppl {:.3}",
            ppl(&Simulated::new(&part)?)?
        );
    }
    let errors = nibble_quant::sim::layer_errors(q, &eval[..eval.len().min(4)], 0)?;
    let mut line = String::from("  down_proj relative error by layer:");
    for (id, e) in &errors {
        if id.kind == nibble_quant::dense::LinearKind::Down {
            line += &format!(" {}:{:.2e}", id.layer, e);
        }
    }
    println!("{line}");
    Ok(())
}
