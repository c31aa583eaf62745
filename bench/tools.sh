# Shared by the profile scripts (sourced, not run).

# require_tool SCRIPT VAR DEFAULT WHAT HINT: set VAR to ${VAR:-DEFAULT} when that command exists;
# otherwise say what is missing and how to get it, and exit 127.
require_tool() {
  local script="$1" var="$2" default="$3" what="$4" hint="$5"
  local cmd="${!var:-$default}"
  if ! command -v "$cmd" >/dev/null 2>&1; then
    echo "$script: '$cmd' ($what) was not found on PATH." >&2
    [ -n "$hint" ] && echo "  $hint" >&2
    echo "  Set $var=/path/to/$default to use another one. Nothing was profiled." >&2
    exit 127
  fi
  printf -v "$var" '%s' "$cmd"
}
