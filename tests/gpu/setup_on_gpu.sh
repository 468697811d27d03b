# Sourced by the GPU machine's one-command runs (tests/gpu/run_e2e_on_gpu.sh, run_fast_restart_on_gpu.sh),
# from the checkout's root, with CARRY (the carried .gpu-carry/), SETUP_LOG and say() defined:
#   1. sshd, ssh, ssh-keygen from the carried Debian packages (unpacked into /opt/ssh, never into /),
#      and pkill/pgrep/ps/fuser the same way where the machine lacks them
#      (shared/reference/gpu-machine-recipe.md);
#   2. pyinfra and the rest from the carried wheels into .gpu-site (a --target dir on PYTHONPATH, so
#      the machine's torch env stays in view), and the checkout's entry points (the `pct` connector, the engines) registered for
#      it (a dist-info beside them: nothing is built there).
# Leaves PY (the interpreter) and PYTHONPATH set.
# ---- 1. OpenSSH (and procps/psmisc) from the carried .debs, where the machine has none
SSH_PREFIX=/opt/ssh
L="$SSH_PREFIX/lib/x86_64-linux-gnu:$SSH_PREFIX/usr/lib/x86_64-linux-gnu"
wrap() {  # wrap NAME BINARY: /usr/bin/NAME (or sbin) runs the unpacked BINARY with its libraries
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$L" "$2" > "$1" && chmod +x "$1"
}
need_debs=0
[ -x /usr/sbin/sshd ] || need_debs=1
for tool in ssh ssh-keygen pkill pgrep ps fuser; do command -v "$tool" >/dev/null 2>&1 || need_debs=1; done
if [ "$need_debs" = 1 ]; then
    if [ -d "$CARRY/debs" ]; then
        say "unpacking $(ls "$CARRY/debs" | wc -l) carried .debs into $SSH_PREFIX"
        mkdir -p "$SSH_PREFIX"
        for f in "$CARRY"/debs/*.deb; do dpkg -x "$f" "$SSH_PREFIX" >>"$SETUP_LOG" 2>&1; done
        if [ ! -x /usr/sbin/sshd ] || grep -q "$SSH_PREFIX" /usr/sbin/sshd 2>/dev/null; then
            rm -f /usr/sbin/sshd   # a symlink left there would make the wrapper overwrite its target
            wrap /usr/sbin/sshd "$SSH_PREFIX/usr/sbin/sshd"
        fi
        id sshd >/dev/null 2>&1 || useradd -r -d /run/sshd -s /usr/sbin/nologin sshd >>"$SETUP_LOG" 2>&1
        for pair in ssh:usr/bin/ssh ssh-keygen:usr/bin/ssh-keygen pkill:usr/bin/pkill pgrep:usr/bin/pgrep \
                    ps:bin/ps fuser:bin/fuser; do
            name="${pair%%:*}"; bin="$SSH_PREFIX/${pair#*:}"
            [ -x "$bin" ] || bin="$SSH_PREFIX/usr/${pair#*:}"
            if ! command -v "$name" >/dev/null 2>&1 && [ -x "$bin" ]; then wrap "/usr/bin/$name" "$bin"; fi
        done
        mkdir -p /usr/lib/openssh && ln -sf "$SSH_PREFIX/usr/lib/openssh/sftp-server" /usr/lib/openssh/sftp-server
    else
        say "no $CARRY/debs and no sshd here: the lab cannot start (run tests/gpu/pack_for_gpu.sh, carry .gpu-carry)"
    fi
fi
for tool in /usr/sbin/sshd ssh ssh-keygen nsenter pkill fuser; do
    command -v "$tool" >/dev/null 2>&1 && say "have $tool" || say "MISSING $tool"
done

# ---- 2. Python packages from the carried wheels
PY=python3
SITE="$PWD/.gpu-site"
if ! $PY -c 'import pyinfra, yaml, jinja2, structlog, pynvml' >/dev/null 2>&1; then
    say "installing the carried wheels into $SITE"
    if ! $PY -m pip install --quiet --no-index --find-links "$CARRY/wheels" --target "$SITE" \
            'pyinfra>=3.10,<4' pyyaml jinja2 structlog nvidia-ml-py >>"$SETUP_LOG" 2>&1; then
        say "pip could not install them; unpacking the wheels directly"
        $PY - "$CARRY/wheels" "$SITE" >>"$SETUP_LOG" 2>&1 <<'EOF'
import pathlib, sys, zipfile
src, site = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
site.mkdir(parents=True, exist_ok=True)
for wheel in sorted(src.glob("*.whl")):
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    print("unpacked", wheel.name)
EOF
    fi
fi
export PYTHONPATH="$PWD:$PWD/lab:$SITE${PYTHONPATH:+:$PYTHONPATH}"   # the lab is its own package, lab/gpugate_lab
# pyinfra finds @pct, and gpugate its engines, through entry points: register the checkout's own
# (pyproject.toml's [project.scripts] and [project.entry-points.*], read there: one list, never a copy)
say "registering the checkout's entry points in $SITE"
mkdir -p "$SITE/gpugate_checkout-0.0.0.dist-info"
printf 'Metadata-Version: 2.1\nName: gpugate-checkout\nVersion: 0.0.0\n' > "$SITE/gpugate_checkout-0.0.0.dist-info/METADATA"
$PY - "$SITE/gpugate_checkout-0.0.0.dist-info/entry_points.txt" <<'EOF'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
with open(sys.argv[1], "w") as out:
    for group, points in groups.items():
        out.write(f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in points.items()) + "\n")
EOF
$PY -c 'import sys, pyinfra, yaml, jinja2, structlog, pynvml, gpugate.engine as e; print("python", sys.version.split()[0], "pyinfra ok, engines", e.names()); assert e.names()' >>"$SETUP_LOG" 2>&1 \
    && say "python packages ok" || say "python packages MISSING (see $SETUP_LOG)"

