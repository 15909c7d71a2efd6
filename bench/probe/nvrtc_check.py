"""Compiles kernel sources with NVRTC here (no GPU needed) and prints the log and the
registers/spills ptxas reports: `python3 bench/probe/nvrtc_check.py ARCH [-DNAME...] FILE...` (the
files are concatenated after kernels/common.cuh, as compile.rs does; -D options as
NIBBLE_NVRTC_DEFINES gives them)."""
import ctypes, os, sys

root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
tk = os.path.join(root, ".cuda-tk/nvidia/cu13")
lib = ctypes.CDLL(os.path.join(tk, "lib/libnvrtc.so.13"))
arch = sys.argv[1]
defines = [a for a in sys.argv[2:] if a.startswith("-D")]
files = [a for a in sys.argv[2:] if not a.startswith("-D")]
common = os.path.join(root, "crates/nibble-cuda/kernels/common.cuh")
src = "\n".join(open(p).read() for p in [common] + files).encode()
prog = ctypes.c_void_p()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"probe.cu", 0, None, None) == 0
opts = [f"--gpu-architecture={arch}", f"--include-path={tk}/include", "--std=c++17",
        "--fmad=true", "-default-device", "-lineinfo", "--ptxas-options=-v"] + defines
arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
size = ctypes.c_size_t()
lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
log = ctypes.create_string_buffer(size.value)
lib.nvrtcGetProgramLog(prog, log)
print(log.value.decode(errors="replace"))
print("rc", rc)
sys.exit(1 if rc else 0)
