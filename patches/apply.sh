#!/usr/bin/env bash
# Apply the megatron_dmuon hook to a Megatron-LM checkout (tag core_v0.19.0, or main of 2026-08-22:
# megatron-core 0.20): pretrain_gpt.py then
# calls megatron_dmuon.megatron.install() before it parses its arguments.
#
#   patches/apply.sh /path/to/Megatron-LM
#
# Idempotent (an already patched tree is left as it is). Refuses, changing nothing, a tree that is not
# a Megatron-LM checkout, whose pretrain_gpt.py does not take the patch, or whose megatron.training
# lacks a symbol install() replaces (docs/megatron_lm.md lists them).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PATCH="$HERE/pretrain_gpt.patch"
SUPPORTED="core_v0.19.0"

die() { echo "patches/apply.sh: $*" >&2; exit 1; }

[ $# -eq 1 ] || { echo "usage: patches/apply.sh /path/to/Megatron-LM" >&2; exit 2; }
TREE="$(cd "$1" 2>/dev/null && pwd)" || die "no such directory: $1"
[ -f "$TREE/pretrain_gpt.py" ] && [ -f "$TREE/megatron/training/arguments.py" ] \
  || die "$TREE is not a Megatron-LM checkout (needs pretrain_gpt.py and megatron/training/); clone NVIDIA/Megatron-LM at $SUPPORTED (or run an unmodified script through python -m megatron_dmuon.megatron.run)"

version="unknown"
info="$TREE/megatron/core/package_info.py"
if [ -f "$info" ]; then
  v() { sed -n "s/^$1 *= *\([0-9][0-9]*\).*/\1/p" "$info" | sed -n 1p; }
  version="$(v MAJOR).$(v MINOR).$(v PATCH)"
fi

# what install() replaces: refuse a tree where any of it moved
need() {  # file, fixed string, what it is
  grep -qF -- "$2" "$TREE/$1" 2>/dev/null \
    || die "$TREE/$1 has no '$2' ($3): this Megatron-LM (megatron-core $version) does not match $SUPPORTED, the version the hook supports"
}
need megatron/training/arguments.py "def add_megatron_arguments(" "parser set-up the hook extends"
need megatron/training/arguments.py "parser = add_megatron_arguments(parser)" "parse_args' call of it"
need megatron/training/arguments.py "def validate_args(" "argument validation the hook wraps"
need megatron/training/training.py "DistributedDataParallel as DDP" "DDP class of get_model"
need megatron/training/training.py "get_megatron_optimizer(" "optimizer factory of setup_model_and_optimizer"
need megatron/training/models/dist_utils.py "DP = DistributedDataParallel" "DDP class of the model builders"
need megatron/training/training.py "from megatron.core.optimizer.qk_clip import clip_qk" "QK-clip after the optimizer step"

apply_patch() {  # args: extra flags; reads the patch on stdin
  if command -v patch >/dev/null 2>&1; then
    patch -p1 -d "$TREE" --forward --fuzz=0 --no-backup-if-mismatch -s "$@" < "$PATCH"
  else
    local check=()
    for a in "$@"; do
      case "$a" in --dry-run) check=(--check) ;; -R) check+=(-R) ;; esac
    done
    (cd "$TREE" && git apply -p1 "${check[@]}" "$PATCH")
  fi
}

if grep -qF "megatron_dmuon.megatron.install()" "$TREE/pretrain_gpt.py"; then
  if apply_patch -R --dry-run >/dev/null 2>&1; then
    echo "patches/apply.sh: $TREE/pretrain_gpt.py already calls megatron_dmuon.megatron.install(); nothing to do"
    exit 0
  fi
  die "$TREE/pretrain_gpt.py mentions megatron_dmuon.megatron.install() but not as pretrain_gpt.patch puts it; restore the file (git -C $TREE checkout pretrain_gpt.py) and run again"
fi
apply_patch --dry-run >/dev/null 2>&1 \
  || die "$TREE/pretrain_gpt.py does not take pretrain_gpt.patch (megatron-core $version; the patch is for $SUPPORTED): check out $SUPPORTED, or add the two lines of patches/pretrain_gpt.patch before parse_and_validate_args yourself"
apply_patch
case "${version%.*}" in
  0.19|0.20) ;;
  *) echo "patches/apply.sh: note: tree reports megatron-core $version; the hook is tested on $SUPPORTED and main (0.20.0)" >&2 ;;
esac
echo "patches/apply.sh: patched $TREE/pretrain_gpt.py: --optimizer dmuon is available (put megatron_dmuon on PYTHONPATH or pip install it)"
