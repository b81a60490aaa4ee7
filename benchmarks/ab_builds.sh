#!/usr/bin/env bash
# Times the matrix kernels of two builds of salaquant in one session on a CUDA machine, alternating them so that
# both see the same GPU state: BASE is another checkout (e.g. `git worktree add BASE HEAD~1`), the other build is
# this tree. Each build is installed into its own folder; JSON and one log go under OUT.
#   Usage: bash benchmarks/ab_builds.sh BASE OUT SITE [BENCHMARK...]
#   SITE: a folder of extra packages put on PYTHONPATH ("" for none); each BENCHMARK a quoted command line of a
#   script in benchmarks/ without --out (default: the W4A16 and NVFP4 tables at 1 and 16 rows), run for both
#   builds in turn, each writing OUT/<script>_<n>_<build>.json.
set -u
base=$1 out=$2 site=${3:-}
shift $(( $# < 3 ? $# : 3 ))
if [ $# -eq 0 ]; then set -- "kernels_w4a16.py --m 1 16 --rep 100" "kernels_nvfp4.py --ms 1,16"; fi
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
log="$out/ab.log"
for b in base head; do  # each from a clean copy, so that no stale build folder leaks into it
  src=$here; [ "$b" = base ] && src=$base
  rm -rf "/tmp/ab-src-$b" "/tmp/ab-$b" && mkdir -p "/tmp/ab-src-$b"
  tar -C "$src" --exclude=./build --exclude=./models --exclude=./.whl --exclude=./.ab-base -cf - . | tar -C "/tmp/ab-src-$b" -xf -
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "/tmp/ab-$b" "/tmp/ab-src-$b" >>"$log" 2>&1
done
run() {  # run BUILD SECONDS SCRIPT ARGS...: one benchmark of one build, from this tree's benchmarks folder
  local b=$1 limit=$2; shift 2
  echo "### $b: $* (limit ${limit}s)" >>"$log"
  (cd "$here/benchmarks" && PYTHONPATH="/tmp/ab-$b${site:+:$site}" timeout "$limit" python3 "$@") >>"$log" 2>&1
  echo "### exit $?" >>"$log"
}
i=0
for bench in "$@"; do
  i=$((i + 1))
  name=$(basename "${bench%% *}" .py)
  # shellcheck disable=SC2086  # the command line splits into its words
  for b in base head; do run $b "${AB_LIMIT:-150}" $bench --out "$out/${name}_${i}_$b.json"; done
done
tail -c 6000 "$log"
