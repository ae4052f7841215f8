#!/bin/sh
# Installs kvx on one host under systemd: the binary, the units, the `kvx` system user,
# /etc/kvx/kvx.env, and enables the units.
#
#   sudo deploy/systemd/install.sh [--bin PATH] [--prefix /usr/local] [--roles agg]
#                                  [--local-etcd] [--no-enable] [--force-env]
#
# Staging (nothing outside DIR is touched, no systemctl call reaches the running system):
#   DESTDIR=/tmp/stage deploy/systemd/install.sh --bin target/release/kvx
#   (or --destdir DIR). Units are enabled with `systemctl --root=DIR`, the user is created
#   in DIR/etc/passwd with `systemd-sysusers --root=DIR`.
#
# Options:
#   --bin PATH      the kvx binary to install (default: target/release/kvx, then ./kvx)
#   --prefix DIR    where the binary goes: DIR/bin/kvx (default /usr/local); the units'
#                   ExecStart= lines are rewritten to it
#   --destdir DIR   stage everything under DIR (same as DESTDIR=DIR)
#   --roles LIST    worker instances to enable, comma-separated: agg (default), or
#                   prefill,decode; `none` enables no worker
#   --local-etcd    etcd runs on this host: install the drop-in that starts etcd.service
#                   before the frontend and the workers
#   --no-enable     install only
#   --force-env     write /etc/kvx/kvx.env even when it exists (default: keep it)
#   --no-frontend   do not enable kvx-frontend.service (a host of workers only)
#
# /etc/kvx/kvx.env comes from `kvx configure --layout host --workers N --format env --out FILE`
# (N: the roles given) when the installed kvx has that command, else from
# deploy/systemd/kvx.env (single host). kvx-planner.service is installed but never enabled:
# it needs a profile and KVX_PLANNER_* settings (see the unit).
set -eu

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
prefix=/usr/local
destdir=${DESTDIR:-}
bin=
roles=agg
local_etcd=0
enable=1
force_env=0
frontend=1

die() { echo "install.sh: $*" >&2; exit 1; }
say() { echo "install.sh: $*"; }

while [ $# -gt 0 ]; do
    case $1 in
        --bin) bin=${2:?--bin needs a path}; shift 2 ;;
        --bin=*) bin=${1#*=}; shift ;;
        --prefix) prefix=${2:?--prefix needs a directory}; shift 2 ;;
        --prefix=*) prefix=${1#*=}; shift ;;
        --destdir) destdir=${2:?--destdir needs a directory}; shift 2 ;;
        --destdir=*) destdir=${1#*=}; shift ;;
        --roles) roles=${2:?--roles needs a list}; shift 2 ;;
        --roles=*) roles=${1#*=}; shift ;;
        --local-etcd) local_etcd=1; shift ;;
        --no-enable) enable=0; shift ;;
        --force-env) force_env=1; shift ;;
        --no-frontend) frontend=0; shift ;;
        -h|--help) sed -n '2,/^set -eu/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done

case $prefix in /*) ;; *) die "--prefix must be absolute: $prefix" ;; esac
if [ -n "$destdir" ]; then
    mkdir -p "$destdir"
    destdir=$(cd "$destdir" && pwd)
elif [ "$(id -u)" -ne 0 ]; then
    die "run as root, or stage with DESTDIR=DIR / --destdir DIR"
fi
if [ -z "$bin" ]; then
    for b in "$repo/target/release/kvx" ./kvx; do
        if [ -x "$b" ]; then bin=$b; break; fi
    done
fi
[ -n "$bin" ] && [ -x "$bin" ] || die "no kvx binary: build it (cargo build --release -p kvx) or pass --bin PATH"
roles=$(echo "$roles" | tr ',' ' ')
for r in $roles; do
    case $r in agg|prefill|decode|none) ;; *) die "unknown worker role: $r (agg, prefill, decode)" ;; esac
done

root=$destdir
unitdir=$root/etc/systemd/system
kvx=$prefix/bin/kvx

# The binary.
install -d -m 0755 "$root$prefix/bin"
install -m 0755 "$bin" "$root$kvx"
say "installed $root$kvx"

# The units, with ExecStart= pointing at the installed binary.
install -d -m 0755 "$unitdir"
for u in kvx-frontend.service kvx-worker@.service kvx-planner.service; do
    sed "s#/usr/local/bin/kvx#$kvx#g" "$here/$u" > "$unitdir/$u.tmp"
    chmod 0644 "$unitdir/$u.tmp"
    mv "$unitdir/$u.tmp" "$unitdir/$u"
done
if [ "$local_etcd" -eq 1 ]; then
    for u in kvx-frontend.service kvx-worker@.service; do
        install -d -m 0755 "$unitdir/$u.d"
        install -m 0644 "$here/discovery-etcd.conf" "$unitdir/$u.d/discovery-etcd.conf"
    done
fi
say "installed units in $unitdir"

# Several workers on one host: each gets its own share of the cores (a worker pins shard i
# to the i-th core it may run on, so two workers with the whole machine would share the
# first cores and leave the rest idle). KVX_SHARDS in kvx.env is the share's size.
n=0
for r in $roles; do [ "$r" = none ] || n=$((n + 1)); done
cores=$(nproc)
if [ "$n" -gt 1 ] && [ "$cores" -ge "$n" ]; then
    share=$((cores / n))
    k=0
    for r in $roles; do
        [ "$r" = none ] && continue
        d=$unitdir/kvx-worker@$r.service.d
        install -d -m 0755 "$d"
        printf '# Written by install.sh: this worker'"'"'s share of the %s cores.\n[Service]\nCPUAffinity=%s-%s\n' \
            "$cores" "$((k * share))" "$((k * share + share - 1))" > "$d/cpus.conf"
        chmod 0644 "$d/cpus.conf"
        k=$((k + 1))
    done
    say "split $cores cores over $n workers ($share each)"
fi

# The user.
install -d -m 0755 "$root/usr/lib/sysusers.d"
install -m 0644 "$here/kvx.sysusers" "$root/usr/lib/sysusers.d/kvx.conf"
if command -v systemd-sysusers >/dev/null 2>&1; then
    if [ -n "$root" ]; then
        systemd-sysusers --root="$root"
    else
        systemd-sysusers /usr/lib/sysusers.d/kvx.conf
    fi
elif [ -z "$root" ] && ! id kvx >/dev/null 2>&1; then
    useradd --system --home-dir /var/lib/kvx --no-create-home --shell /usr/sbin/nologin \
        --comment "kvx inference appliance" kvx
fi

# The settings.
install -d -m 0755 "$root/etc/kvx"
env_file=$root/etc/kvx/kvx.env
if [ -e "$env_file" ] && [ "$force_env" -eq 0 ]; then
    say "kept $env_file (--force-env to rewrite it)"
elif "$root$kvx" configure --help >/dev/null 2>&1; then
    "$root$kvx" configure --layout host --workers "$((n > 0 ? n : 1))" --format env --out "$env_file"
    say "wrote $env_file with kvx configure"
else
    install -m 0640 "$here/kvx.env" "$env_file"
    say "wrote $env_file (single-host defaults; this kvx has no \`configure\` command)"
fi

# Each enabled worker's own file, when it has none: on one host without etcd, workers join
# the frontend's worker plane (KVX_WORKER_LISTEN, default 127.0.0.1:7100).
joins=1
grep -Eq '^(KVX_FRONTEND|KVX_WORKER_ADDR)=|^KVX_DISCOVERY=etcd' "$env_file" && joins=0
plane=$(sed -n 's/^KVX_WORKER_LISTEN=//p' "$env_file" | tail -n 1)
plane=${plane:-127.0.0.1:7100}
for r in $roles; do
    [ "$r" = none ] && continue
    f=$root/etc/kvx/worker-$r.env
    [ -e "$f" ] && continue
    {
        echo "# KVX_* settings of kvx-worker@$r.service only (after /etc/kvx/kvx.env)."
        echo "#KVX_SHARDS=8"
        echo "#KVX_KV_DISK=/var/lib/kvx/worker-$r/kv"
        if [ "$joins" -eq 1 ]; then echo "KVX_FRONTEND=$plane"; fi
    } > "$f"
    chmod 0640 "$f"
    say "wrote $f"
done

# Enabling.
if [ "$enable" -eq 1 ]; then
    units=
    [ "$frontend" -eq 1 ] && units=" kvx-frontend.service"
    for r in $roles; do
        [ "$r" = none ] || units="$units kvx-worker@$r.service"
    done
    if [ -n "$units" ]; then
        if [ -n "$root" ]; then
            # shellcheck disable=SC2086
            systemctl --root="$root" enable $units
        else
            systemctl daemon-reload
            # shellcheck disable=SC2086
            systemctl enable $units
        fi
        say "enabled:$units (start: systemctl start$units)"
    fi
elif [ -z "$root" ]; then
    systemctl daemon-reload
fi
say "kvx-planner.service is installed, not enabled: it needs a profile and KVX_PLANNER_* settings (see the unit)"
