#!/usr/bin/env bash
# A built wheel, installed (not editable) into a fresh venv, must find its configs and
# register its plugins through entry points.
set -euo pipefail
root=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m pip wheel -q --no-deps -w "$work/dist" "$root"
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q torch==2.13.0
"$work/venv/bin/python" -m pip install -q "$work"/dist/accelopt-*.whl
cd "$work"
"$work/venv/bin/python" - <<'PY'
import json, subprocess, sys, pathlib
import accelopt, accelopt.configs
assert "site-packages" in accelopt.__file__, accelopt.__file__
assert (pathlib.Path(accelopt.configs.__file__).parent / "config.yaml").is_file()
out = subprocess.run([sys.prefix + "/bin/accelopt", "plugins", "--json"], check=True,
                     capture_output=True, text=True).stdout
names = {p["name"] for p in json.loads(out)}
assert "noop" in names, names
print("wheel install ok: plugins", sorted(names))
PY
"$work/venv/bin/accelopt" run +plugins=[noop] workload=tiny run.progress=false >/dev/null
test -n "$(find "$work/runs" -name metrics.json)"
echo "wheel run ok"
