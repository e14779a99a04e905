# Source this on a GPU machine that reaches no package index (docs/BENCHMARKS.md, "Running on a
# rented GPU machine"): it installs the wheels of .whl/ (made by scripts/device_wheels.sh where an
# index is reachable) once per machine into /tmp/site-<digest of the wheel set> and puts that
# folder, alone, on PYTHONPATH. A warm machine keeps the folder between calls, so a second script
# on the same machine installs nothing; a changed wheel set gets a new folder, so a process still
# running from the old one (a detached training run) is never pulled out from under. Exports
# QEDPROBE_COMMIT (the wheel's commit, .whl/BUILD) for the model cards. With QEDPROBE_EXTRA_WHEELS
# naming a folder, its wheels are installed beside them (FlashQLA's: scripts/device_wheels.sh
# --flashqla).
_wheels="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.whl"
ls "$_wheels"/*.whl > /dev/null 2>&1 || { echo "no wheels in $_wheels: run scripts/device_wheels.sh where a package index is reachable and copy .whl/ here"; return 1; }
_all=("$_wheels"/*.whl)
if [[ -n ${QEDPROBE_EXTRA_WHEELS:-} ]]; then
    ls "$QEDPROBE_EXTRA_WHEELS"/*.whl > /dev/null 2>&1 || { echo "QEDPROBE_EXTRA_WHEELS=$QEDPROBE_EXTRA_WHEELS holds no wheels"; return 1; }
    _all+=("$QEDPROBE_EXTRA_WHEELS"/*.whl)
fi
_site=/tmp/site-$(md5sum -- "${_all[@]}" | cut -d' ' -f1 | md5sum | cut -c1-12)
if [[ ! -f $_site/.complete ]]; then
    rm -rf "$_site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$_site" "${_all[@]}" \
        || { echo "pip could not install ${_all[*]} into $_site"; return 1; }
    touch "$_site/.complete"
fi
export PYTHONPATH=$_site PYTHONUNBUFFERED=1
# The commit the qedprobe wheel was built from, for the model cards of runs trained here.
[[ -f $_wheels/BUILD ]] && export QEDPROBE_COMMIT=$(cat "$_wheels/BUILD")
