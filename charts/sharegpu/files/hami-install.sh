# Copy HAMi-core's libvgpu.so out of HAMi's image (init container of the sharegpu agent).
#   HAMI_LIB_DIR  where the image keeps it: libvgpu.so.<version> (releases before v2.8:
#                 libvgpu.so)
#   HAMI_VERSION  the release, e.g. v2.10.0
#   DEST          a host directory: the library goes to DEST/hami-<version>-<digest>/libvgpu.so
#                 and DEST/installed names it (the agent's --hami-installed)
# A library file, once there, is never written again: running containers map it.
set -eu
src="$HAMI_LIB_DIR/libvgpu.so.$HAMI_VERSION"
[ -f "$src" ] || src="$HAMI_LIB_DIR/libvgpu.so"
if [ ! -f "$src" ]; then
  echo "hami-install: neither libvgpu.so.$HAMI_VERSION nor libvgpu.so in $HAMI_LIB_DIR" >&2
  ls -l "$HAMI_LIB_DIR" >&2 || true
  exit 1
fi
digest=$(sha256sum "$src" | cut -c1-16)
dir="$DEST/hami-$HAMI_VERSION-$digest"
if [ ! -f "$dir/libvgpu.so" ]; then
  mkdir -p "$dir"
  tmp="$dir/.libvgpu.so.$$"
  cp "$src" "$tmp"
  chmod 0755 "$tmp"
  mv -f "$tmp" "$dir/libvgpu.so"
  echo "hami-install: installed $dir/libvgpu.so"
else
  echo "hami-install: $dir/libvgpu.so is already installed"
fi
printf '%s\n' "$dir/libvgpu.so" > "$DEST/.installed.$$"
mv -f "$DEST/.installed.$$" "$DEST/installed"
