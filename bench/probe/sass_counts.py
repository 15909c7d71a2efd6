"""SASS of the qgemm module's entry points, compiled here with NVRTC (no GPU needed), and per
entry the counts that show an epilogue's shape: branches, convergence regions (BSSY), calls, global
loads and stores, MUFU. `python3 bench/probe/sass_counts.py [ARCH] [--files A.cu,B.cu] [--order]
ENTRY...` (ARCH default sm_90a; --files another module's sources after common.cuh, e.g. comet.cu, or kv_pages.cuh,decode_mma.cu,prefill.cu,kv_quant.cu
with -DNIBBLE_KVQ_MODULE and the pool's -DNIBBLE_KVQ_* defines; --dump prints each entry's SASS;
--order prints each entry's loads, tensor-core ops and barriers in program order; NVRTC from test.sh's .cuda-tk, the disassembler from the nvidia-cuda-nvdisasm wheel,
fetched into .cuda-tk/nvdisasm once).
How the SwiGLU epilogue's per-output branches were found (BENCHMARKS.md, issue 18)."""
import ctypes, glob, os, re, subprocess, sys, tempfile

root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
tk = os.path.join(root, ".cuda-tk/nvidia/cu13")
args = sys.argv[1:]
arch = args.pop(0) if args and args[0].startswith("sm_") else "sm_90a"
module = None
if args and args[0] == "--files":
    module = ["common.cuh"] + args[1].split(",")
    args = args[2:]
defines = []
while args and args[0].startswith("-D"):
    defines.append(args.pop(0))
dump = bool(args) and args[0] == "--dump"
if dump:
    args = args[1:]
order = bool(args) and args[0] == "--order"
if order:
    args = args[1:]
disasm_dir = os.path.join(root, ".cuda-tk/nvdisasm")
nvdisasm = os.path.join(disasm_dir, "nvidia/cu13/bin/nvdisasm")
if not os.path.exists(nvdisasm):
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    disasm_dir, "nvidia-cuda-nvdisasm==13.2.86"], check=True)
# NVRTC opens its builtins by name: load them first so no LD_LIBRARY_PATH is needed.
ctypes.CDLL(os.path.join(tk, "lib/libnvrtc-builtins.so.13.0"), mode=ctypes.RTLD_GLOBAL)
lib = ctypes.CDLL(os.path.join(tk, "lib/libnvrtc.so.13"))
kernels = os.path.join(root, "crates/nibble-cuda/kernels")
files = ["common.cuh", "qgemm.cu", "qgemv.cu", "hopper.cuh", "qgemm_wgmma.cu", "qgemm_fp8.cu",
         "qgemv_grouped.cu", "gemv_dense.cu"]
src = "\n".join(open(os.path.join(kernels, f)).read() for f in module or files).encode()
prog = ctypes.c_void_p()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"qgemm.cu", 0, None, None) == 0
opts = [f"--gpu-architecture={arch}", f"--include-path={tk}/include", "--std=c++17",
        "--fmad=true", "-default-device"] + defines
rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts]))
if rc:
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    sys.exit(log.value.decode(errors="replace"))
size = ctypes.c_size_t()
lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
cubin = ctypes.create_string_buffer(size.value)
lib.nvrtcGetCUBIN(prog, cubin)
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(cubin.raw)
    f.flush()
    sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
print(f"{'entry':36s} instrs   BRA  BSSY  CALL   LDG   STG  MUFU")
for entry in args:
    i = sass.index(f".text.{entry}:")
    j = sass.find(".text.", i + 10)
    body = [l for l in sass[i:j if j > 0 else None].splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", l)]
    count = lambda op: sum(op in l for l in body)
    print(f"{entry:36s} {len(body):6d} {count('BRA'):5d} {count('BSSY'):5d} {count('CALL'):5d} "
          f"{count('LDG'):5d} {count('STG'):5d} {count('MUFU'):5d}")
    if dump:
        print("\n".join(body))
    if order:
        ops = [m.group(1) for l in body
               if (m := re.search(r"\b(LDG[.\w]*|LDS[.\w]*|STS[.\w]*|IMMA[.\w]*|HMMA[.\w]*|HGMMA[.\w]*|BAR[.\w]*|BRA)\b", l))]
        print("  " + " ".join(ops))
