#!/usr/bin/env bash
# Make .bridge_whl: the wheels Megatron-Bridge 0.6.2's training path needs on the offline H200 image (Python
# 3.12) beyond what the image holds and what .te/.whl carry (pydantic, emerging-optimizers, megatron-core).
# Two wheels are repacked without binaries that path never loads (PuLP's CBC solver, multi-storage-client's
# Rust client): the whole carry must stay under the device tool's 64 MiB. Run here, once:
#   bash launch/bridge/h200_wheels.sh [.bridge_whl]
set -euo pipefail
OUT=${1:-.bridge_whl}; mkdir -p "$OUT"
grep -qx '/.bridge_whl/' .git/info/exclude 2>/dev/null || echo '/.bridge_whl/' >> .git/info/exclude
WHEELS=(megatron-bridge==0.6.2 nvidia-modelopt==0.47.0 nvidia-resiliency-ext==0.6.0 multi-storage-client==0.40.0
        megatron-energon==7.4.1 datasets==5.2.0 omegaconf==2.4.0 rapidyaml==0.15.2 rpds-py==2026.9.1 cffi==2.1.1
        multiprocess==0.70.19 dill==0.4.1 pulp==3.3.2 lark==1.3.1 jsonschema==4.26.0 webdataset==1.0.2
        opentelemetry-api==1.45.2 wcmatch==12.0.4 xattr==1.3.1 referencing==0.37.0 defusedxml==0.7.1 filetype==1.2.0
        jsonschema-specifications==2025.9.1 bracex==3.2.4 deprecation==2.1.0 braceexpand==0.1.7)
PLATFORMS=(); for n in 39 35 34 31 28 27 17; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$OUT" "${WHEELS[@]}"
python3 - "$OUT" <<'PY'
"""Repack: drop a package's binaries that Bridge's training path never loads; RECORD follows."""
import glob, os, sys, zipfile

def repack(pattern, drop, rename=None):
    for src in glob.glob(os.path.join(sys.argv[1], pattern)):
        dst = src + ".tmp"
        with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zo:
            for item in zi.infolist():
                if item.filename.startswith(drop):
                    continue
                data = zi.read(item.filename)
                if item.filename.endswith(".dist-info/RECORD"):
                    data = b"\n".join(l for l in data.split(b"\n") if not l.startswith(drop.encode()))
                zo.writestr(item, data)
        os.replace(dst, src)
        print("repacked", os.path.basename(src), os.path.getsize(src), "bytes")

repack("pulp-3.3.2-*.whl", "pulp/solverdir/")            # modelopt only imports pulp
repack("multi_storage_client-*.whl", "multistorageclient_rust/")  # s3/gcs providers only
PY
du -sh "$OUT"
