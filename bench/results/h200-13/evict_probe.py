"""Does posix_fadvise(DONTNEED) drop a file's pages on this machine? (cold PLE runs showed 0.999 resident)."""
import mmap, os, subprocess, sys, time
sys.path.insert(0, os.getcwd())
from ple_service.page_cache import evict, mapped_rss, resident_fraction
d = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
print(subprocess.run(f"uname -r; stat -f -c '%T' {d}; df -h {d} | tail -1; grep -E 'MemFree|^Cached|Dirty|Mlocked' /proc/meminfo", shell=True, capture_output=True, text=True).stdout)
p = os.path.join(d, "evict_probe.bin")
with open(p, "wb") as f:
    for _ in range(8):
        f.write(os.urandom(64 << 20))
    f.flush(); os.fsync(f.fileno())
print("written, resident", resident_fraction([p]))
evict(p); print("after evict", resident_fraction([p]))
with open(p, "rb") as f:
    f.read(); print("after read", resident_fraction([p]))
fd = os.open(p, os.O_RDONLY); m = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
print("mapped untouched; evict ->", (evict(p), resident_fraction([p]))[1], mapped_rss(p))
_ = bytes(m[: 256 << 20]); evict(p); print("mapped, 1/2 touched; evict ->", resident_fraction([p]), mapped_rss(p))
t = time.time(); open("/proc/sys/vm/drop_caches", "w").write("1\n") if os.access("/proc/sys/vm/drop_caches", os.W_OK) else print("drop_caches not writable")
print("drop_caches ->", resident_fraction([p]), f"{time.time() - t:.2f} s")
os.unlink(p)
