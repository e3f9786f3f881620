# Shared helpers for scripts/*: dependency installation, build environment, and
# services started in the background and stopped by PID. Source it; do not run it.

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RUN_DIR=${AMBER_RUN_DIR:-$ROOT/.run}
mkdir -p "$RUN_DIR"

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# Debian packages the build, the tests and the demo need (chromium and its driver: the
# catalog pages' browser test).
DEB_PACKAGES=(
  librocksdb-dev libclang-dev clang pkg-config
  docker.io skopeo buildah podman docker-registry uidmap
  busybox-static erofs-utils curl file debootstrap attr mount
  e2fsprogs kmod
  chromium chromium-driver
)
# PyPI packages the tests need (moto: an S3-compatible server; 5.2.2+ answers
# CompleteMultipartUpload with the element name the AWS SDKs expect).
# httpx, pytest, pytest-asyncio, wheel: the Python client, its tests and its install
# (without build isolation: nothing fetched at test time); schemathesis: the
# property-based tester of amberd's OpenAPI document (hypothesis pinned: newer ones break
# schemathesis 3.39).
PIP_PACKAGES=(oras==0.2.43 "moto[server]==5.2.5" httpx==0.28.1 pytest==8.3.5 pytest-asyncio==0.25.3 schemathesis==3.39.16 hypothesis==6.115.0 wheel==0.45.1)
# crates.io binaries the tests need: s3s-fs, an S3-compatible server with data on disk
# and real signature checks.
S3S_FS_VERSION=0.14.1

install_deps() {
  local missing=()
  for p in "${DEB_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "installing Debian packages: ${missing[*]}"
    local sudo=; [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  fi
  local pip_missing=()
  for p in "${PIP_PACKAGES[@]}"; do
    local name=${p%%==*} want=${p##*==}
    [ "$(python3 -m pip show "${name%%[*}" 2>/dev/null | awk '/^Version:/ {print $2}')" = "$want" ] ||
      pip_missing+=("$p")
  done
  if ((${#pip_missing[@]})); then
    log "installing PyPI packages: ${pip_missing[*]}"
    python3 -m pip install -q "${pip_missing[@]}"
  fi
  # QEMU's system emulator comes from bookworm-backports (it matches the preinstalled
  # backports qemu-utils; bookworm's own conflicts with it).
  if ! command -v qemu-system-x86_64 >/dev/null; then
    log "installing qemu-system-x86 from bookworm-backports"
    local sudo=; [ "$(id -u)" = 0 ] || sudo=sudo
    if ! grep -rqs bookworm-backports /etc/apt/sources.list /etc/apt/sources.list.d/; then
      printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' |
        $sudo tee /etc/apt/sources.list.d/amber-backports.sources >/dev/null
    fi
    $sudo apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends -t bookworm-backports qemu-system-x86 >/dev/null
  fi
  command -v cargo >/dev/null || die "cargo is not installed (this machine kind has rustup's toolchain)"
  if ! s3s-fs --version 2>/dev/null | grep -q "$S3S_FS_VERSION"; then
    log "installing s3s-fs $S3S_FS_VERSION (cargo install, a few minutes once)"
    cargo install -q "s3s-fs@$S3S_FS_VERSION" --features binary --locked
  fi
}

# Build against Debian's RocksDB (minutes instead of a quarter hour for the bundled one),
# linked statically: see registry/build.rs for why. Builds go to one target directory per
# machine outside the clone (a fresh clone reuses what the last one built: about 12 of a
# cold CI run's minutes are the build), unless CARGO_TARGET_DIR says otherwise.
build_env() {
  export ROCKSDB_LIB_DIR=/usr/lib/x86_64-linux-gnu
  export ROCKSDB_INCLUDE_DIR=/usr/include
  export ROCKSDB_STATIC=1
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/amber-target}
  export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# stop_pid NAME: stops the service recorded in $RUN_DIR/NAME.pid, waits for it to exit.
stop_pid() {
  local f="$RUN_DIR/$1.pid"
  if pid_alive "$f"; then
    local pid; pid=$(cat "$f")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

# stop_dockerd: stops our Docker engine and unmounts what it left mounted under its
# directory (the network namespace of its default network), so the run dir can be removed.
stop_dockerd() {
  stop_pid dockerd
  local m
  for m in $(awk -v d="$RUN_DIR/docker/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r); do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  done
}

# free_port: a TCP port nobody listens on now, on loopback.
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# wait_http NAME URL: waits for a service started in the background to answer.
wait_http() {
  for _ in $(seq 300); do
    curl -s -o /dev/null "$2" && return 0
    pid_alive "$RUN_DIR/$1.pid" || break
    sleep 0.1
  done
  die "$1 did not start (log: $RUN_DIR/$1.log)"
}

# start_s3_servers: moto (in memory, conditional writes) and s3s-fs (on disk, real
# signatures) on loopback, each with the bucket amber-test. Exports
# AMBER_TEST_S3_ENDPOINTS (name=url,...) and AMBER_TEST_S3_BUCKET.
start_s3_servers() {
  stop_s3_servers
  local moto_port s3s_port
  moto_port=$(free_port)
  moto_server -H 127.0.0.1 -p "$moto_port" >"$RUN_DIR/moto.log" 2>&1 &
  echo $! >"$RUN_DIR/moto.pid"
  rm -rf "$RUN_DIR/s3s-fs" && mkdir -p "$RUN_DIR/s3s-fs/amber-test"
  s3s_port=$(free_port)
  s3s-fs --host 127.0.0.1 --port "$s3s_port" --access-key amber --secret-key amber-secret \
    "$RUN_DIR/s3s-fs" >"$RUN_DIR/s3s-fs.log" 2>&1 &
  echo $! >"$RUN_DIR/s3s-fs.pid"
  wait_http moto "http://127.0.0.1:$moto_port/"
  wait_http s3s-fs "http://127.0.0.1:$s3s_port/"
  curl -fsS -X PUT -o /dev/null "http://127.0.0.1:$moto_port/amber-test" || die "creating the moto bucket"
  export AMBER_TEST_S3_ENDPOINTS="moto=http://127.0.0.1:$moto_port,s3s-fs=http://127.0.0.1:$s3s_port"
  export AMBER_TEST_S3_BUCKET=amber-test
  log "S3 servers: $AMBER_TEST_S3_ENDPOINTS"
}

stop_s3_servers() {
  stop_pid moto
  stop_pid s3s-fs
}

# start_dockerd: a Docker engine of our own on a Unix socket in $RUN_DIR, no networking
# changes on the host. Exports DOCKER_SOCK and DOCKER_STORAGE_DRIVER. Storage is vfs,
# which copies every layer's whole tree (6.5 GB of images by the end of a test run).
# AMBER_DOCKER_STORAGE_DRIVER="overlay2 vfs" tries overlay2 first (layers shared, 2.4 GB
# by the same point); it is not the default because the one full test run on it had a
# `docker build` RUN step and a sandbox fail that pass on vfs, not yet understood.
start_dockerd() {
  local d="$RUN_DIR/docker" driver
  stop_dockerd
  mkdir -p "$d"
  rm -rf "$d/root" # the data root of earlier checkouts, always vfs
  export DOCKER_SOCK="unix://$d/docker.sock"
  for driver in ${AMBER_DOCKER_STORAGE_DRIVER:-vfs}; do
    log "starting a Docker engine on $DOCKER_SOCK ($driver storage)"
    dockerd --iptables=false --ip6tables=false --ip-masq=false --bridge=none \
      --storage-driver="$driver" --data-root "$d/root-$driver" --exec-root "$d/exec" \
      --pidfile "$d/dockerd.pid" --host "$DOCKER_SOCK" >"$d/dockerd.log" 2>&1 &
    echo $! >"$RUN_DIR/dockerd.pid"
    for _ in $(seq 300); do
      if docker -H "$DOCKER_SOCK" version >/dev/null 2>&1; then
        export DOCKER_STORAGE_DRIVER=$driver
        return 0
      fi
      pid_alive "$RUN_DIR/dockerd.pid" || break
      sleep 0.1
    done
    tail -5 "$d/dockerd.log" >&2
    stop_dockerd
    cp "$d/dockerd.log" "$d/dockerd-$driver.log"
  done
  die "the Docker engine did not start (logs: $d/dockerd-*.log)"
}
