# shellcheck shell=bash
# Sourced by the set-up scripts (bootstrap, install-llama-server, run-tests, provision-demo):
# no exit without a message. Under `set -e` a failing command ends the script; this ERR trap
# says first which script, which line and which command failed, with its exit status, and what
# to do. errtrace (-E) carries the trap into functions and command substitutions.
# Usage: . "$(dirname "$0")/errtrap.sh"; errtrap_install NAME "what to do"
errtrap_install() {
    ERRTRAP_NAME="$1"
    ERRTRAP_HINT="${2:-fix what the lines above say, then run it again: it continues where it stopped}"
    set -E
    trap 'errtrap_report "$?" "$LINENO" "$BASH_COMMAND"' ERR
}
errtrap_report() {
    local rc="$1" line="$2" cmd="$3"
    trap - ERR
    if [ "$BASH_SUBSHELL" -gt 0 ]; then  # a $(...) or ( ... ): name the command; the script reports
        printf '%s: inside line %s: %s (exit %s)\n' "$ERRTRAP_NAME" "$line" "$cmd" "$rc" >&2
        exit "$rc"
    fi
    printf '%s: FAILED (exit %s) at line %s: %s\n' "$ERRTRAP_NAME" "$rc" "$line" "$cmd" >&2
    [ "$rc" = 141 ] && printf '%s: (exit 141 is SIGPIPE: a reader closed the pipe early)\n' "$ERRTRAP_NAME" >&2
    printf '%s: %s\n' "$ERRTRAP_NAME" "$ERRTRAP_HINT" >&2
    exit "$rc"
}
