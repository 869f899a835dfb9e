# Sourced by the .ci scripts that run pip or build the lab images.

# pip, quietly; this machine's pip config names local indexes that may be absent, and the
# "is ignored" lines pip prints about them are dropped. Usage: quiet_pip PIP ARGS...
quiet_pip() {
    local pip=$1
    shift
    "$pip" -q --disable-pip-version-check "$@" 2> >(grep -v 'is ignored' >&2)
}

# The hash of the inputs an image was built from (its org.sparkple.inputs label; empty when
# the image is missing): an image whose label matches its inputs' hash is not rebuilt.
image_inputs() {
    docker image inspect --format '{{index .Config.Labels "org.sparkple.inputs"}}' "$1" 2>/dev/null || true
}

# The classic builder: the lab builds offline from local base images only.
export DOCKER_BUILDKIT=0

# A cache entry, built once per machine: cache_entry DIR BUILD RECORD..., where BUILD DIR fills
# the empty directory DIR. It runs under DIR.lock (the lock harness/wheel_cache.py takes for its
# entries) unless DIR/.complete is there; a half-built DIR (no .complete, say after a kill) is
# removed and built again, and .complete, holding the RECORD lines (what DIR was built from),
# is written only once BUILD has succeeded (call it as a plain command: bash ignores errexit
# inside a function called from an `if` or `||`).
cache_entry() {
    local dir=$1 build=$2
    shift 2
    (
        set -e
        flock 9
        [[ -f $dir/.complete ]] && exit 0
        rm -rf "$dir"
        mkdir -p "$dir"
        "$build" "$dir"
        printf '%s\n' "$@" >"$dir/.complete"
    ) 9>"$dir.lock"
}
