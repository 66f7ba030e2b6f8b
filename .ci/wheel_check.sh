#!/usr/bin/env bash
# A built wheel, installed (not editable) into a fresh venv, must find its configs and
# register its plugins through entry points.
set -euo pipefail
root=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m pip wheel -q --no-deps -w "$work/dist" "$root"
python3 -m venv "$work/venv"
# The fresh venv gets the third-party packages this venv already installed (torch and the
# rest) as hard links, in seconds instead of a second download and unpack of torch; nothing
# of accelopt comes with them (no editable finder, no dist-info of accelopt or the example
# plugins). `pip check` then proves the wheel's declared requirements are all satisfied.
here=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
there=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$there"/setuptools "$there"/setuptools-* "$there"/_distutils_hack "$there"/distutils-precedence.pth
for entry in "$here"/*; do
  case "$(basename "$entry")" in
    __editable__*|accelopt*|pip|pip-*|__pycache__) continue ;;
  esac
  cp -al "$entry" "$there/" 2>/dev/null || cp -a "$entry" "$there/"  # another filesystem: copy
done
"$work/venv/bin/python" -m pip install -q --no-deps "$work"/dist/accelopt-*.whl
"$work/venv/bin/python" -m pip check
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
