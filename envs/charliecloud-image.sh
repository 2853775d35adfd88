#!/usr/bin/env bash
# `make image`: a Charliecloud directory image of the project's pinned environment at
# images/ddpflow, for machine.container: {runtime: charliecloud, image: images/ddpflow}
# (docs/software-on-the-nodes.md). Offline apart from the package registries:
#   1. Debian's minimal base and its python3 from the apt mirror (debootstrap, as root; the
#      .debs are kept in $DEBOOTSTRAP_CACHE, so a rebuild downloads nothing);
#   2. the packages `make` installed into .venv from envs/requirements.txt (torch with CUDA
#      and NCCL, ...), hard-linked into the image's dist-packages: the very files the login
#      node plans with, without a second 6 GB copy (copied where images/ is on another file
#      system); the developer tools (ruff, mypy, playwright) are left out;
#   3. ddpflow itself is the project's: a .pth names this checkout's workflow/ folder, which
#      every job binds at its own path, so an edit needs no rebuild.
# The ranks check the image's ddpflow, torch, CUDA and NCCL against the login node's anyway.
# Environment: IMAGE (images/ddpflow), VENV (.venv), DEBIAN_SUITE (bookworm), DEBIAN_MIRROR
# (this machine's apt mirror), DEBOOTSTRAP_CACHE (/var/cache/ddpflow-debootstrap).
set -euo pipefail

out=${IMAGE:-images/ddpflow}
venv=${VENV:-.venv}
suite=${DEBIAN_SUITE:-bookworm}
cache=${DEBOOTSTRAP_CACHE:-/var/cache/ddpflow-debootstrap}
mirror=${DEBIAN_MIRROR:-$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)}
mirror=${mirror:-http://deb.debian.org/debian}
project=$(pwd -P)
SECONDS=0

say() { echo "make image: $*"; }
die() { echo "make image: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "debootstrap needs root (or build envs/ddpflow.def with apptainer build --fakeroot)"
command -v debootstrap >/dev/null || die "debootstrap is missing: apt-get install debootstrap"
command -v ch-run >/dev/null || die "ch-run is missing: apt-get install charliecloud-runtime"
[ -x "$venv/bin/python" ] || die "$venv is missing: run make first"
version=$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
site="$venv/lib/python$version/site-packages"

tmp="$out.building"
rm -rf "$tmp"
mkdir -p "$(dirname "$out")" "$cache"
say "Debian $suite (minbase + python3) from $mirror into $tmp"
debootstrap --variant=minbase --include=python3 --cache-dir="$cache" \
    "$suite" "$tmp" "$mirror" >"$tmp.debootstrap.log" 2>&1 \
    || { tail -20 "$tmp.debootstrap.log" >&2; die "debootstrap failed (log: $tmp.debootstrap.log)"; }
rm -f "$tmp.debootstrap.log"
# what a job never reads: apt's lists and caches, documentation, translations
rm -rf "$tmp"/var/cache/apt/* "$tmp"/var/lib/apt/lists/* \
    "$tmp"/usr/share/doc/* "$tmp"/usr/share/man/* "$tmp"/usr/share/locale/* "$tmp"/usr/share/info/*

[ -x "$tmp/usr/bin/python$version" ] || die "the image's python3 is not $version (.venv's): \
set DEBIAN_SUITE to the Debian release whose python3 is $version"
target="$tmp/usr/local/lib/python$version/dist-packages"
mkdir -p "$target"
mapfile -t entries < <(cd "$site" && ls -A | grep -Ev \
    '^(__editable__.*ddpflow.*|ddpflow-.*\.dist-info|playwright.*|mypy.*|.*__mypyc.*|ruff.*|pip|pip-.*)$')
if (cd "$site" && cp -al "${entries[@]}" "$OLDPWD/$target/") 2>/dev/null; then
    linked="hard links to $site"
else
    rm -rf "${target:?}"/*
    (cd "$site" && cp -a "${entries[@]}" "$OLDPWD/$target/")
    linked="a copy of $site (another file system)"
fi
echo "$project/workflow" >"$target/ddpflow-project.pth"
mkdir -p "$tmp$project"  # the mount point of the project (ch-run binds only where one exists)
# ch-run binds the host's name files over these, if the image has them: node names resolve
touch "$tmp/etc/hosts" "$tmp/etc/resolv.conf"

# the image's own record of what it holds (ddpflow reads the versions themselves)
cat >"$tmp/etc/ddpflow-image" <<EOF
built: $(date -u +%Y-%m-%dT%H:%M:%SZ) by make image in $project
base: Debian $suite minbase from $mirror
packages: $linked ($(ls "$target" | grep -c dist-info) distributions)
EOF

say "checking it: ch-run $tmp -- python3 (torch and ddpflow import)"
USER=${USER:-$(id -un)} ch-run -b "$project:$project" --set-env=PATH=/usr/local/bin:/usr/bin:/bin \
    "$tmp" -- python3 -c 'import ddpflow, torch, numpy, submitit; print("python3 with torch", torch.__version__, "and ddpflow", ddpflow.__version__, "from", ddpflow.__path__[0])'

rm -rf "$out"
mv "$tmp" "$out"
say "$out is ready in ${SECONDS}s: $(du -sm --exclude="usr/local/lib/python$version/dist-packages" "$out" | cut -f1) MB base + $linked"
