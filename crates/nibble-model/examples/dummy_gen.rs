//! Times building every tensor of a dummy model, one at a time as `Transformer::load` would:
//! `cargo run --release -p nibble-model --example dummy_gen -- llama-3-8b [seed]`.

use std::time::Instant;

use nibble_model::dummy::open_dummy;
use nibble_model::{TensorLayout, model_tensors};

fn main() -> nibble_core::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let name = args.first().map_or("llama-3-8b", String::as_str);
    let seed = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let start = Instant::now();
    let files = open_dummy(name, seed)?;
    let opened = start.elapsed();
    let layout = TensorLayout::from_names(
        [
            "lm_head.weight",
            "model.layers.0.self_attn.q_proj.bias",
            "model.layers.0.self_attn.q_norm.weight",
        ]
        .into_iter()
        .filter(|n| files.source.contains(n)),
    );
    let names: Vec<String> = model_tensors(&files.config, &layout)
        .into_iter()
        .map(|(n, _, _)| n)
        .collect();
    let (mut elems, mut biggest) = (0usize, (0f64, String::new()));
    let gen_start = Instant::now();
    for n in &names {
        let t0 = Instant::now();
        let t = files.source.get(n).expect("listed tensor");
        let dt = t0.elapsed().as_secs_f64();
        if dt > biggest.0 {
            biggest = (dt, n.clone());
        }
        elems += t.elems();
    }
    let total = gen_start.elapsed().as_secs_f64();
    println!(
        "{name}: opened (config + tokenizer) in {:.3} s; {} tensors, {:.3e} values in {total:.2} s \
         ({:.2} ns/value, {:.2} ns/value/thread on {} threads); slowest {} in {:.3} s",
        opened.as_secs_f64(),
        names.len(),
        elems as f64,
        total * 1e9 / elems as f64,
        total * 1e9 * rayon::current_num_threads() as f64 / elems as f64,
        rayon::current_num_threads(),
        biggest.1,
        biggest.0,
    );
    Ok(())
}
