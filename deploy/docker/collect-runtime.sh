#!/usr/bin/env bash
# Copies executables and the shared libraries they load into a root-filesystem tree, for the
# runtime stage of deploy/docker's images to copy whole:
#   OUT/usr/local/bin/EXECUTABLE...                (debug information stripped, symbols kept)
#   OUT/usr/local/lib/fusedps/*.so.*          (gRPC, protobuf, abseil, prometheus-cpp, OpenMP...)
#   OUT/etc/ld.so.conf.d/fusedps.conf         (so that `ldconfig` finds them)
#
#   usage: collect-runtime.sh OUT EXECUTABLE...
#
# Left out on purpose: the C library family, libstdc++ and libgcc_s (the runtime image is the
# same distribution release as the build image, so its own are the same), and the NVIDIA driver
# libraries (libcuda, libnvidia-*), which the NVIDIA container runtime mounts from the host.
set -euo pipefail
if (($# < 2)); then
  echo "usage: collect-runtime.sh OUT EXECUTABLE..." >&2
  exit 2
fi
out=$1
shift
libdir=/usr/local/lib/fusedps
mkdir -p "$out/usr/local/bin" "$out$libdir" "$out/etc/ld.so.conf.d"
echo "$libdir" >"$out/etc/ld.so.conf.d/fusedps.conf"
skip='^(libc|libm|libmvec|libpthread|libdl|librt|libresolv|libutil|ld-linux[^ ]*|libstdc\+\+|libgcc_s|libcuda|libnvidia[^ ]*)\.so'
for exe in "$@"; do
  [[ -x $exe ]] || { echo "collect-runtime: $exe is not an executable" >&2; exit 2; }
  cp -L "$exe" "$out/usr/local/bin/"
  # RelWithDebInfo's DWARF is most of each file; the symbol table stays, for glog's stack traces.
  strip --strip-debug "$out/usr/local/bin/$(basename "$exe")"
  # "libfoo.so.1 => /usr/lib/x86_64-linux-gnu/libfoo.so.1 (0x...)": keep the soname as the name.
  if ldd "$exe" | grep -q 'not found'; then
    ldd "$exe" >&2
    echo "collect-runtime: $exe has unresolved libraries" >&2
    exit 1
  fi
  ldd "$exe" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r soname path; do
    [[ $soname =~ $skip ]] && continue
    cp -L "$path" "$out$libdir/$soname"
  done
done
echo "collect-runtime: $(ls "$out/usr/local/bin" | wc -l) executables," \
  "$(ls "$out$libdir" | wc -l) libraries, $(du -sh "$out" | cut -f1) in $out" >&2
