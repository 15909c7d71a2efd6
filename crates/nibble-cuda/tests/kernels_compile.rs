//! Every embedded kernel source compiles with NVRTC for each GPU generation nibble supports, and
//! the cubin's entry points are found. Needs NVRTC and the CUDA headers but no GPU: test.sh
//! installs both from pip and sets NIBBLE_REQUIRE_NVRTC=1, which turns a missing NVRTC into a
//! failure; a bare `cargo test` without them prints that it skipped.

use nibble_cuda::{compile, module, probe};

fn unavailable(why: &str) {
    assert!(
        std::env::var_os("NIBBLE_REQUIRE_NVRTC").is_none(),
        "NIBBLE_REQUIRE_NVRTC is set but {why}"
    );
    eprintln!("skipped: {why}");
}

/// The CUDA headers' folder where NVRTC and the headers are installed; otherwise None, after
/// [`unavailable`] has said why.
fn nvrtc_headers() -> Option<std::path::PathBuf> {
    if !probe::nvrtc_available() {
        unavailable("NVRTC is not installed here");
        return None;
    }
    probe::cuda_include_dir()
        .map_err(|e| unavailable(&e.to_string()))
        .ok()
}

#[test]
fn kernels_compile_for_every_architecture() {
    let Some(include) = nvrtc_headers() else {
        return;
    };
    // One thread per architecture: NVRTC compiles are independent and take seconds each.
    std::thread::scope(|scope| {
        for cc in [(8, 0), (8, 6), (8, 9), (9, 0)] {
            let include = &include;
            scope.spawn(move || {
                let arch = compile::arch_for(cc);
                let opts = compile::options(&arch, include);
                let mut all_entries = Vec::new();
                for (name, text) in compile::SOURCES {
                    let cubin = compile::compile(name, &compile::full_source(text), &opts)
                        .unwrap_or_else(|e| panic!("{name} for {arch}: {e}"));
                    let entries = module::entry_points(&cubin);
                    assert!(!entries.is_empty(), "{name} for {arch}: no entry points");
                    let want: &[&str] = match *name {
                        "attention" => &["paged_attn_bf16_hd128_g4", "attn_reduce_f16_hd64_g8"],
                        "elementwise" => &[
                            "quantize_i8_bf16",
                            "quantize_f8_f32",
                            "rms_norm_f8_bf16",
                            "silu_mul_f8_f16",
                            "rope",
                            "rope_angles",
                        ],
                        "decode_mma" => &["decode_mma_bf16_hd128_g4", "decode_mma_f16_hd64_g8"],
                        "comet" => &[
                            "comet_quantize_f32",
                            "comet_quantize_bf16",
                            "comet_quantize_f16",
                            "comet_gemm_f32",
                            "comet_gemm_bf16",
                            "comet_gemm_f16",
                            "comet_gemv1_f32",
                            "comet_gemv2_bf16",
                            "comet_gemv4_f16",
                        ],
                        // The wgmma tier exists from sm_90 (sm_90a) on.
                        "prefill" if cc.0 >= 9 => &[
                            "prefill_attn_bf16_hd128",
                            "prefill_attn_f16_hd64",
                            "prefill_wgmma_bf16_hd128",
                            "prefill_wgmma_bf16_hd64",
                            "prefill_wgmma_f16_hd128",
                            "prefill_wgmma_f16_hd64",
                        ],
                        "prefill" => &["prefill_attn_bf16_hd128", "prefill_attn_f16_hd64"],
                        // The decode gemv exists from sm_90 on; the mma.sync tier everywhere.
                        "qgemm" if cc.0 >= 9 => &[
                            "w4a16_dec1_bf16",
                            "w4a16_dec2_h_g64_f16",
                            "w8a8_dec2_f32",
                            "fp8_dec4_bf16",
                            "fp8_wgmma128_f32",
                            "w4a16_gemv1_f16",
                            // COMET past its decode gemv (src/comet.rs, launch_wgmma).
                            "comet_wgmma64_f32",
                            "comet_wgmma128_f32",
                            "comet_wgmma64_bf16",
                            "comet_wgmma128_bf16",
                            "comet_wgmma64_f16",
                            "comet_wgmma128_f16",
                        ],
                        "qgemm" => &["w4a16_gemv1_bf16", "w8a8_tiled_f32"],
                        _ => &[],
                    };
                    if *name == "qgemm" {
                        // Every entry point the quantized-GEMM dispatch can ask for exists: the
                        // gemv up to 64 tokens, the tiled kernels, and from sm_90 the decode gemv
                        // up to 16 tokens and the wgmma kernels.
                        use nibble_cuda::qlinear::{
                            QFamily, normed_kernel_name, qgemm_kernel_name, swiglu_kernel_name,
                        };
                        for family in QFamily::ALL {
                            for out_half in [false, true] {
                                for sfx in ["bf16", "f16"] {
                                    for m in 1..=64 {
                                        for kind in family.kernels(cc.0 >= 9, m) {
                                            let e =
                                                qgemm_kernel_name(kind, family, m, out_half, sfx);
                                            assert!(entries.contains(&e), "{arch}: {e} missing");
                                            if family.has_swiglu() && kind.has_swiglu_entry() {
                                                let e = swiglu_kernel_name(kind, family, m, sfx);
                                                assert!(entries.contains(&e), "{arch}: {e}");
                                            }
                                            // The one-token decode gemv that norms its input.
                                            if let Some(e) = (m == 1)
                                                .then(|| normed_kernel_name(kind, family, sfx))
                                                .flatten()
                                            {
                                                assert!(entries.contains(&e), "{arch}: {e}");
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                    if *name == "qgemm" {
                        // Every grouped expert kernel `grouped::grouped_gemm` may launch: the
                        // mma.sync grouped gemv everywhere, the grouped decode gemv from sm_90.
                        for e in nibble_cuda::grouped::kernel_names() {
                            let hopper = e.contains("_gdec");
                            assert_eq!(entries.contains(&e), !hopper || cc.0 >= 9, "{arch}: {e}");
                        }
                    }
                    if *name == "qgemm" {
                        // The dense decode gemv, every token count and dtype, from sm_90.
                        for m in 1..=nibble_cuda::dense_gemv::MAX_TOKENS {
                            for kb in nibble_cuda::dense_gemv::STAGES_KB {
                                for sfx in ["bf16", "f16"] {
                                    let e = nibble_cuda::dense_gemv::kernel_name(m, kb, sfx);
                                    assert_eq!(entries.contains(&e), cc.0 >= 9, "{arch}: {e}");
                                }
                            }
                            for sfx in ["bf16", "f16"] {
                                for peer in [false, true] {
                                    for swiglu in [false, true] {
                                        let e = nibble_cuda::dense_gemv::norm_kernel_name(
                                            sfx, peer, swiglu,
                                        );
                                        assert_eq!(entries.contains(&e), cc.0 >= 9, "{arch}: {e}");
                                    }
                                }
                                let e = nibble_cuda::dense_gemv::push_kernel_name(sfx);
                                assert_eq!(entries.contains(&e), cc.0 >= 9, "{arch}: {e}");
                            }
                            let e = "peer_sum_settle".to_string();
                            assert_eq!(entries.contains(&e), cc.0 >= 9, "{arch}: {e}");
                        }
                    }
                    all_entries.extend(entries.iter().cloned());
                    if *name == "qgemm" && cc.0 < 9 {
                        assert!(
                            !entries
                                .iter()
                                .any(|e| e.contains("_dec") || e.contains("_wgmma")),
                            "{arch}: {entries:?}"
                        );
                    }
                    for w in want {
                        assert!(entries.iter().any(|e| e == w), "{w} missing: {entries:?}");
                    }
                }
                // The quantized-KV attention module, per pool format: every format on Hopper
                // (both dtypes for one), one format elsewhere.
                use nibble_cuda::PageFormat;
                let mut kv_formats = Vec::new();
                for k in PageFormat::ALL {
                    for v in PageFormat::ALL {
                        if [k, v] != [PageFormat::Float; 2] && (cc.0 >= 9 || kv_formats.is_empty())
                        {
                            kv_formats.push((k, v));
                        }
                    }
                }
                let kv_formats: Vec<(PageFormat, PageFormat, bool)> =
                    kv_formats.into_iter().map(|(k, v)| (k, v, false)).collect();
                // The channel-wise formats' modules (not wired to pools yet): kv4c, kv2c, k8v4c,
                // k4cv8, on Hopper.
                let mut kv_formats = kv_formats;
                if cc.0 >= 9 {
                    let [c4, c2, u2] = PageFormat::DEFERRED;
                    let [_, u8_, u4, _] = PageFormat::ALL;
                    kv_formats.extend([
                        (c4, u4, true),
                        (c2, u2, true),
                        (u8_, u4, true),
                        (c4, u8_, false),
                    ]);
                }
                for (i, &(k, v, v_deferred)) in kv_formats.iter().enumerate() {
                    for dtype in if i == 0 {
                        &["bf16", "f16"][..]
                    } else {
                        &["bf16"]
                    } {
                        let kinds = [k.kernel_code(), v.kernel_code()];
                        let o = compile::kv_quant_options(&opts, dtype, kinds, v_deferred);
                        let src = compile::full_source(compile::KV_QUANT);
                        let cubin = compile::compile("kv_quant", &src, &o).unwrap_or_else(|e| {
                            panic!("kv_quant {k:?}/{v:?} {dtype} for {arch}: {e}")
                        });
                        let entries = module::entry_points(&cubin);
                        for hd in [64, 128] {
                            for g in [1, 2, 4, 8] {
                                let e = format!("kvq_decode_hd{hd}_g{g}");
                                assert!(entries.contains(&e), "{arch} {k:?}/{v:?}: {e} missing");
                            }
                            let deferred = v_deferred || matches!(k, PageFormat::Channel(_));
                            let writers: &[&str] = if deferred {
                                &["kvq_append_residual_hd", "kvq_pack_hd"]
                            } else {
                                &["kvq_append_hd"]
                            };
                            for e in ["kvq_prefill_hd", "kvq_fill_random_hd"]
                                .iter()
                                .chain(writers)
                            {
                                let e = format!("{e}{hd}");
                                assert!(entries.contains(&e), "{arch} {k:?}/{v:?}: {e} missing");
                            }
                        }
                        // The 16-bit pool's kernels are not compiled again.
                        assert!(
                            !entries
                                .iter()
                                .any(|e| e.starts_with("decode_mma_")
                                    || e.starts_with("prefill_attn_")),
                            "{entries:?}"
                        );
                        all_entries.extend(entries);
                    }
                }
                // Every name prefix of the kernels launched early on Hopper names kernels there
                // (a stale entry would silently launch nothing early).
                if cc.0 >= 9 {
                    for prefix in compile::GRID_WAITING_KERNELS {
                        assert!(
                            all_entries.iter().any(|e| e.starts_with(prefix)),
                            "GRID_WAITING_KERNELS: no kernel '{prefix}*' for {arch}"
                        );
                    }
                }
            });
        }
    });
}

#[test]
fn no_wgmma_is_serialized() {
    // ptxas serializes a kernel's wgmmas (each waits for the last before it issues) when other
    // instructions touch a wgmma's accumulators while it is in flight, and only says so in its
    // report (C7514). It did so in every FP8 entry until 2026-11-27 (BENCHMARKS.md, issue 18).
    let Some(include) = nvrtc_headers() else {
        return;
    };
    let mut opts = compile::options("sm_90a", &include);
    opts.push("--ptxas-options=-v".into());
    let runs: Vec<(&str, &str)> = compile::SOURCES
        .iter()
        .copied()
        .filter(|(_, text)| text.contains("wgmma"))
        .collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = runs
            .into_iter()
            .map(|(name, text)| {
                let opts = &opts;
                scope.spawn(move || {
                    let log = compile::compile_log(name, &compile::full_source(text), opts)
                        .unwrap_or_else(|e| panic!("{name}: {e}"));
                    assert!(
                        log.contains("Compiling entry function"),
                        "{name}: no ptxas report"
                    );
                    let serialized: Vec<&str> =
                        log.lines().filter(|l| l.contains("C7514")).collect();
                    assert!(serialized.is_empty(), "{name}: {serialized:#?}");
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    });
}

/// Every kernel that Hopper launches early (`compile::GRID_WAITING_KERNELS`: it may start while
/// the kernel before it still runs) waits on the grid dependency somewhere in its code; one that
/// does not reads its inputs before they are written.
#[test]
fn kernels_launched_early_wait_on_the_grid() {
    let Some(include) = nvrtc_headers() else {
        return;
    };
    let opts = compile::options("compute_90a", &include);
    let mut modules: Vec<(String, String, Vec<String>)> = compile::SOURCES
        .iter()
        .map(|(name, text)| (name.to_string(), compile::full_source(text), opts.clone()))
        .collect();
    // The quantized-KV module in a per-token and a channel-wise pool format.
    use nibble_cuda::PageFormat;
    let [_, int8, int4, _] = PageFormat::ALL;
    let [c4, ..] = PageFormat::DEFERRED;
    for (k, v, deferred) in [(int8, int4, false), (c4, int4, true)] {
        let kinds = [k.kernel_code(), v.kernel_code()];
        modules.push((
            format!("kv_quant {k:?}/{v:?}"),
            compile::full_source(compile::KV_QUANT),
            compile::kv_quant_options(&opts, "bf16", kinds, deferred),
        ));
    }
    let mut checked = 0;
    std::thread::scope(|scope| {
        let handles: Vec<_> = modules
            .iter()
            .map(|(name, src, o)| {
                scope.spawn(move || {
                    let ptx = compile::ptx(name, src, o).unwrap_or_else(|e| panic!("{name}: {e}"));
                    let (waiting, not_waiting) = compile::ptx_grid_waits(&ptx);
                    let early: Vec<&String> = not_waiting
                        .iter()
                        .filter(|e| compile::waits_on_grid_first(e))
                        .collect();
                    assert!(
                        early.is_empty(),
                        "{name}: launched early, never wait: {early:?}"
                    );
                    waiting.len()
                })
            })
            .collect();
        for h in handles {
            checked += h.join().unwrap();
        }
    });
    assert!(checked > 50, "only {checked} waiting kernels found");
}

#[test]
fn ptx_entries_are_split_by_their_grid_wait() {
    let ptx = ".visible .entry a(\n){\n griddepcontrol.wait;\n ret;\n}\n\
               .visible .entry b_2(\n){\n ret;\n}\n";
    let (waiting, not) = compile::ptx_grid_waits(ptx);
    assert_eq!(waiting, ["a"]);
    assert_eq!(not, ["b_2"]);
}

#[test]
fn compile_errors_show_the_nvrtc_log() {
    let Some(include) = nvrtc_headers() else {
        return;
    };
    let opts = compile::options("sm_90a", &include);
    let e = compile::compile(
        "broken",
        "extern \"C\" __global__ void k() { undeclared_thing; }",
        &opts,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("undeclared_thing"), "{e}");
}

#[test]
fn compiled_kernels_are_cached_on_disk_by_source_and_options() {
    let Some(include) = nvrtc_headers() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let src = compile::full_source("extern \"C\" __global__ void k(float* x) { x[0] = 1.0f; }");
    let opts = compile::options("sm_80", &include);
    let first = compile::cubin_cached_in(Some(dir.path()), "k", &src, &opts).unwrap();
    let files: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(files.len(), 1, "one cubin cached");
    // A cache hit returns the stored bytes: prove it by planting different ones.
    let path = files[0].as_ref().unwrap().path();
    std::fs::write(&path, b"planted").unwrap();
    let again = compile::cubin_cached_in(Some(dir.path()), "k", &src, &opts).unwrap();
    assert_eq!(again, b"planted");
    // Other options or another architecture is another key.
    let other = compile::cubin_cached_in(
        Some(dir.path()),
        "k",
        &src,
        &compile::options("sm_90a", &include),
    )
    .unwrap();
    assert_ne!(other, b"planted");
    assert_ne!(other, first, "sm_90a and sm_80 cubins differ");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
}

#[test]
fn modules_compile_side_by_side_and_come_back_in_order() {
    let Some(include) = nvrtc_headers() else {
        return;
    };
    let opts = compile::options("sm_80", &include);
    let dir = tempfile::tempdir().unwrap();
    let modules = [
        (
            "first",
            "extern \"C\" __global__ void k_first(float* x) { x[0] = 1.0f; }",
        ),
        (
            "second",
            "extern \"C\" __global__ void k_second(float* x) { x[0] = 2.0f; }",
        ),
        (
            "third",
            "extern \"C\" __global__ void k_third(float* x) { x[0] = 3.0f; }",
        ),
    ];
    let cubins = compile::cubins_cached_in(Some(dir.path()), &modules, &opts).unwrap();
    let entries: Vec<Vec<String>> = cubins.iter().map(|c| module::entry_points(c)).collect();
    assert_eq!(entries, [["k_first"], ["k_second"], ["k_third"]]);
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        3,
        "each cached"
    );
    // One module that does not compile fails the whole set, naming what NVRTC said.
    let broken = [
        modules[0],
        (
            "broken",
            "extern \"C\" __global__ void k() { undeclared_thing; }",
        ),
    ];
    let e = compile::cubins_cached_in(None, &broken, &opts)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("broken") && e.contains("undeclared_thing"),
        "{e}"
    );
}

#[test]
fn the_cache_key_leaves_out_where_the_headers_were_found() {
    // A cubin compiled where pip installed the headers is the one a GPU machine with the
    // toolkit's headers (and the same NVRTC) would compile: scripts/gpu-precompile.sh.
    if !probe::nvrtc_available() {
        return unavailable("NVRTC is not installed here");
    }
    let opts = |include: &str, arch: &str| compile::options(arch, std::path::Path::new(include));
    let src = "extern \"C\" __global__ void k() {}";
    let here = compile::cache_key(src, &opts("/work/.cuda-tk/nvidia/cu13/include", "sm_90a"));
    let there = compile::cache_key(src, &opts("/usr/local/cuda/include", "sm_90a"));
    assert_eq!(here, there);
    assert_ne!(
        here,
        compile::cache_key(src, &opts("/usr/local/cuda/include", "sm_80"))
    );
    assert_ne!(
        here,
        compile::cache_key("// another\n", &opts("/usr/local/cuda/include", "sm_90a"))
    );
    let mut defined = opts("/usr/local/cuda/include", "sm_90a");
    defined.push("-DSOME_VARIANT".into());
    assert_ne!(here, compile::cache_key(src, &defined));
}
