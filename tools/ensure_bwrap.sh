#!/usr/bin/env bash
# The grader's sandbox needs bubblewrap. Installs it where this runs as root with apt-get; otherwise
# names the package and stops. Then checks that it can really make the namespaces the grader asks for:
# where it cannot (a container without user namespaces) it warns and goes on, because the grader
# itself refuses every candidate there (trusted=true grades the oracles) and the tests that need the
# sandbox skip, saying why.
set -euo pipefail
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing bubblewrap (apt-get) for the grader's sandbox"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null; }
  else
    echo "error: the grader's sandbox needs bubblewrap: install the 'bubblewrap' package" \
         "(apt-get install bubblewrap, dnf install bubblewrap, ...) and run make again" >&2
    exit 1
  fi
fi
if ! bwrap --unshare-all --unshare-user --disable-userns --die-with-parent --new-session \
     --ro-bind /usr /usr --symlink usr/lib64 /lib64 --symlink usr/lib /lib --symlink usr/bin /bin \
     --proc /proc --dev /dev true 2>/tmp/t2j-bwrap-check.err; then
  echo "warning: bubblewrap is installed but cannot create user namespaces here:" \
       "$(cat /tmp/t2j-bwrap-check.err). The grader will refuse candidates; trusted=true grades the oracles" \
       "behind the Python-level fence only." >&2
fi
