#!/usr/bin/env bash
# softroce/vm.sh - run host-built programs against the kernel's Soft-RoCE (rdma_rxe) in a
# throw-away qemu VM. Real libibverbs, real RC transport (in the guest kernel), no RDMA NIC.
#
#   softroce/vm.sh prepare                  build the guest image into the cache (idempotent)
#   softroce/vm.sh run EXE [ARGS...]        boot, run EXE in the guest, exit with its exit code
#                                           (works as a cargo runner, see below)
#   softroce/vm.sh batch EXE [ARGS...] [::: EXE [ARGS...]]...
#                                           boot once, run the programs in turn; exit 0 when
#                                           all pass, else the first failure's exit code
#   softroce/vm.sh shell                    interactive guest shell with the rxe devices up
#   softroce/vm.sh pair A-PROGRAMS... --vm-b B-PROGRAMS...
#                                           two VMs joined by a virtual Ethernet cable (qemu
#                                           stream netdev, virtio-net, MTU 9000), rxe0 on eth0
#                                           of each: A (192.0.2.1) starts its programs at once
#                                           (servers: stdin closes when B is done), B
#                                           (192.0.2.2) runs its programs in turn (batch
#                                           syntax); exit B's first failure, else A's
#
# cargo runner:  CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="$PWD/softroce/vm.sh run" \
#                  cargo test -p rpc-core --features ibverbs --test ib_smoke
#
# The image is built from Debian bookworm packages only (apt-get download): Debian's kernel
# (which ships rdma_rxe), and an initramfs with busybox, glibc, rdma-core's libibverbs +
# providers, ibverbs-utils and iproute2's `rdma`. Programs are copied in at their host path,
# with the host shared libraries the guest lacks; the guest runs them in the host's cwd.
#
# Guest network: no NIC at all. dummy0 carries 192.0.2.1 (TEST-NET-1) and rxe0; with
# SOFTROCE_RXE=2 also dummy1/192.0.2.2/rxe1. GID index 1 of each is the IPv4-mapped RoCE v2 GID.
# Tests see SOFTROCE=1, SOFTROCE_DEVICES="rxe0 rxe1", SOFTROCE_GID_INDEX=1, SOFTROCE_IP.
# `pair`: no dummy NIC; eth0 (virtio) with 192.0.2.1 (A) / 192.0.2.2 (B), rxe0 on it; programs
# also see SOFTROCE_PEER_IP (the other VM), SOFTROCE_PAIR_ROLE (a|b), SOFTROCE_NETDEV=eth0.
# Network namespaces cannot replace the second VM: rxe in Linux 6.1 keeps its UDP socket in
# the initial namespace, so RoCE packets that arrive in another one are lost (tried: QPs on
# both ends of a veth pair, one end in a namespace, exchange nothing).
#
# Exit codes: the program's; 124 the VM timed out; 125 the VM died without reporting (the
# console is printed); 126 guest setup failed (modprobe / rdma link); 130 interrupted.
#
# Environment:
#   SOFTROCE_CACHE     cache dir (default ${XDG_CACHE_HOME:-~/.cache}/rdma-rpc/softroce)
#   SOFTROCE_RXE       number of rxe devices, 1 or 2 (default 1)
#   SOFTROCE_TIMEOUT   seconds for the whole VM (default 900)
#   SOFTROCE_TEST_TIMEOUT  seconds per program inside the guest (default 600)
#   SOFTROCE_MEM / SOFTROCE_SMP  guest RAM (default 2048M) / vCPUs (default 2)
#   SOFTROCE_ACCEL     tcg (default) | kvm | auto (kvm only with real VMX/SVM, not PVM hosts)
#   SOFTROCE_EXTRA     host files or dirs copied into the guest at the same paths
#   SOFTROCE_PASS_ENV  more variable names to pass (RUST_*, CARGO_*, RPC_*, SOFTROCE_* pass)
#   SOFTROCE_VERBOSE=1 print the guest console afterwards
#   SOFTROCE_KERNEL_PKG  pin the kernel package (default: what linux-image-amd64 depends on)
#   SOFTROCE_NET_MTU   pair: eth0's MTU in both VMs (default 9000: rxe's active MTU 4096)
#   SOFTROCE_NET_MTU_B pair: eth0's MTU in VM B only (an MTU-mismatch set-up)
#   SOFTROCE_PAIR_GRACE  pair: seconds VM A may take to finish after VM B (default 120)
set -uo pipefail

SELF=$(realpath "${BASH_SOURCE[0]}")
CACHE=${SOFTROCE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rdma-rpc/softroce}
# Bump when the image recipe below changes: a cache of another version is rebuilt.
RECIPE=6

GUEST_PKGS=(busybox-static libc6 libgcc-s1 libibverbs1 ibverbs-providers librdmacm1
            libnl-3-200 libnl-route-3-200 ibverbs-utils iproute2 libmnl0 libbsd0 libmd0 libcap2
            libbpf1 libelf1 libxtables12 zlib1g)
# modules rxe needs (modprobe resolves the order from modules.dep), the virtio NIC of `pair`,
# veth and netem (tc qdisc ... netem) for fault injection
GUEST_MODS=(crc32_generic udp_tunnel ip6_udp_tunnel ib_core ib_uverbs rdma_rxe dummy
            virtio virtio_ring virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci
            failover net_failover virtio_net veth sch_netem)

say() { printf 'softroce: %s\n' "$*" >&2; }
die() { say "$*"; exit 125; }

# --------------------------------------------------------------------------------- prepare
prepare() {
  mkdir -p "$CACHE" || die "cannot create $CACHE"
  exec 8>"$CACHE/.lock"
  flock 8
  if [[ "$(cat "$CACHE/ready" 2>/dev/null)" == "$RECIPE" ]]; then
    exec 8>&-
    return 0
  fi
  local t0=$SECONDS
  rm -f "$CACHE/ready"
  command -v qemu-system-x86_64 >/dev/null ||
    die "qemu-system-x86_64 is missing: apt-get install --no-install-recommends qemu-system-x86"
  local t
  for t in apt-get apt-cache dpkg-deb xz; do
    command -v $t >/dev/null || die "$t is missing on the host (Debian/Ubuntu tools needed)"
  done

  local kpkg=${SOFTROCE_KERNEL_PKG:-}
  if [[ -z "$kpkg" ]]; then
    kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | sed -n 's/.*Depends: \(linux-image-[0-9][^ ]*\).*/\1/p' | head -1)
    if [[ -z "$kpkg" ]]; then
      say "apt lists are missing; running apt-get update"
      apt-get update -qq || die "apt-get update failed"
      kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | sed -n 's/.*Depends: \(linux-image-[0-9][^ ]*\).*/\1/p' | head -1)
    fi
  fi
  [[ -n "$kpkg" ]] || die "cannot find the kernel package behind linux-image-amd64"
  local kver=${kpkg#linux-image-}
  say "building the guest image in $CACHE (kernel $kpkg)"

  local debs="$CACHE/debs"
  rm -rf "$debs" && mkdir -p "$debs"
  if ! (cd "$debs" && apt-get download -qq -o APT::Sandbox::User=root "$kpkg" "${GUEST_PKGS[@]}" >/dev/null); then
    say "apt-get download failed; refreshing the apt lists once"
    apt-get update -qq || die "apt-get update failed"
    (cd "$debs" && apt-get download -qq -o APT::Sandbox::User=root "$kpkg" "${GUEST_PKGS[@]}" >/dev/null) ||
      die "apt-get download of the guest packages failed"
  fi

  # Kernel: vmlinuz + config + the modules we need, in one pass over the 70 MB package.
  local kx="$CACHE/kx" root="$CACHE/root"
  rm -rf "$kx" "$root" && mkdir -p "$kx" "$root"
  local pats=("./boot/vmlinuz-$kver" "./boot/config-$kver" "./lib/modules/$kver/modules.*")
  local m
  for m in "${GUEST_MODS[@]}"; do pats+=("./lib/modules/$kver/kernel/*/$m.ko*"); done
  dpkg-deb --fsys-tarfile "$debs"/linux-image-*.deb | tar -x -C "$kx" --wildcards "${pats[@]}" 2>/dev/null
  [[ -f "$kx/boot/vmlinuz-$kver" ]] || die "no vmlinuz in $kpkg"
  grep -q '^CONFIG_RDMA_RXE=[ym]' "$kx/boot/config-$kver" ||
    die "$kpkg has no rdma_rxe (the -cloud flavour lacks it; use the generic amd64 kernel)"
  # qemu boots an ELF vmlinux through its PVH note: that skips the guest's own decompression
  # (seconds under TCG). Find the xz (6.1) or zstd (6.12) stream inside the bzImage and unpack
  # it once.
  local off vz="$kx/boot/vmlinuz-$kver"
  rm -f "$CACHE/vmlinux"
  off=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$vz" | head -1 | cut -d: -f1)
  if [[ -n "$off" ]]; then
    tail -c +$((off + 1)) "$vz" | xz -dc --single-stream >"$CACHE/vmlinux.tmp" 2>/dev/null
  elif command -v zstd >/dev/null &&
       off=$(LC_ALL=C grep -obUaP '\x28\xb5\x2f\xfd' "$vz" | head -1 | cut -d: -f1) && [[ -n "$off" ]]; then
    tail -c +$((off + 1)) "$vz" | zstd -dcq >"$CACHE/vmlinux.tmp" 2>/dev/null
  fi
  if [[ -s "$CACHE/vmlinux.tmp" ]] && head -c 4 "$CACHE/vmlinux.tmp" | grep -q ELF; then
    mv "$CACHE/vmlinux.tmp" "$CACHE/vmlinux"
  fi
  rm -f "$CACHE/vmlinux.tmp"
  cp "$kx/boot/vmlinuz-$kver" "$CACHE/vmlinuz"
  [[ -f "$CACHE/vmlinux" ]] || say "no ELF vmlinux extracted: booting the bzImage (slower)"

  # Root: the packages unpacked, pruned, plus modules and our init.
  local d
  for d in "$debs"/*.deb; do
    [[ "$d" == */linux-image-* ]] || dpkg-deb -x "$d" "$root"
  done
  rm -rf "$root"/usr/share/{doc,man,info,locale,lintian,bug,bash-completion,zsh} \
         "$root"/usr/include "$root"/usr/lib/x86_64-linux-gnu/gconv "$root"/etc/iproute2 "$root"/usr/lib/tc
  # iproute2's `ip` (netns, veth, link down/up) and `tc` (netem) stay; busybox has neither.
  for t in arpd genl bridge dcb devlink rtacct rtmon tipc vdpa ss ctstat lnstat nstat routel; do
    rm -f "$root"/{bin,sbin,usr/bin,usr/sbin}/$t
  done
  mkdir -p "$root"/{proc,sys,dev,tmp,run,root,bb,etc,softroce} "$root/lib/modules"
  chmod 1777 "$root/tmp"
  cp -a "$kx/lib/modules/$kver" "$root/lib/modules/"
  for m in "${GUEST_MODS[@]}"; do
    find "$root/lib/modules/$kver" -name "$m.ko*" | grep -q . || die "module $m is missing from $kpkg"
  done
  local bb="$root/bin/busybox"
  [[ -x "$bb" ]] || die "busybox-static did not unpack"
  for t in $("$bb" --list); do ln -sf /bin/busybox "$root/bb/$t"; done
  ln -sf busybox "$root/bin/sh"
  ln -sf /bin/busybox "$root/sbin/modprobe"
  "$bb" depmod -b "$root" "$kver" || die "depmod failed"
  cp "$bb" "$CACHE/busybox"   # the host has no cpio; busybox's is used to pack archives
  printf 'root:x:0:0:root:/root:/bin/sh\n' >"$root/etc/passwd"
  printf 'root:x:0:\n' >"$root/etc/group"
  printf '127.0.0.1 localhost\n' >"$root/etc/hosts"
  printf 'hosts: files\n' >"$root/etc/nsswitch.conf"
  write_init >"$root/init"
  chmod 755 "$root/init"
  check_libs "$root"

  (cd "$root" && find . | LC_ALL=C sort | "$CACHE/busybox" cpio -o -H newc -R 0:0 2>/dev/null) >"$CACHE/base.cpio.tmp" ||
    die "packing the initramfs failed"
  mv "$CACHE/base.cpio.tmp" "$CACHE/base.cpio"
  rm -rf "$kx"
  for d in "$debs"/*.deb; do dpkg-deb -f "$d" Package Version | paste -sd' '; done >"$CACHE/manifest.txt"
  echo "$RECIPE" >"$CACHE/ready"
  say "guest image ready in $((SECONDS - t0)) s ($(du -sh "$CACHE/base.cpio" | cut -f1) initramfs)"
  exec 8>&-
}

# Every ELF of the guest must find its libraries inside the guest.
check_libs() {
  local root=$1 f lib missing=0
  command -v readelf >/dev/null || return 0
  while IFS= read -r f; do
    while IFS= read -r lib; do
      if ! compgen -G "$root/lib/x86_64-linux-gnu/$lib" >/dev/null &&
         ! compgen -G "$root/usr/lib/x86_64-linux-gnu/$lib" >/dev/null &&
         ! compgen -G "$root/lib64/$lib" >/dev/null; then
        say "warning: ${f#"$root"} needs $lib, which the guest lacks"
        missing=1
      fi
    done < <(readelf -d "$f" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  done < <(find "$root"/usr/bin "$root"/usr/sbin "$root"/sbin "$root"/bin \
             "$root"/usr/lib/x86_64-linux-gnu/libibverbs -type f 2>/dev/null)
  return $missing
}

write_init() {
  cat <<'INIT'
#!/bin/sh
# rdma-rpc Soft-RoCE guest (PID 1). ttyS0: console + status, ttyS1: program stdout,
# ttyS2: program stderr. /softroce/env and /softroce/cmd come with the per-run archive.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin:/bb HOME=/root TERM=dumb
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts pts /dev/pts
mount -t tmpfs shm /dev/shm
SOFTROCE_MARK=none SOFTROCE_RXE=1
. /softroce/env
log() { echo "softroce-guest[$(cut -d' ' -f1 /proc/uptime)]: $*"; }
bye() { echo "SOFTROCE_RC_${SOFTROCE_MARK}=$1"; sync; poweroff -f; }
ulimit -l unlimited
log "kernel up"
for m in crc32_generic ib_uverbs rdma_rxe dummy; do
  modprobe "$m" || { log "modprobe $m failed"; bye 126; }
done
ip link set lo up
devs=
if [ "${SOFTROCE_NET:-dummy}" = virtio ]; then
  # `vm.sh pair`: a virtio NIC joined to the other VM; rxe0 on it.
  for m in virtio_pci virtio_net sch_netem; do
    modprobe "$m" || { log "modprobe $m failed"; bye 126; }
  done
  n=0
  until ip link show eth0 >/dev/null 2>&1; do
    n=$((n + 1)); [ "$n" -gt 500 ] && { log "no eth0 (virtio-net)"; bye 126; }
    usleep 10000
  done
  ip link set eth0 mtu "$SOFTROCE_NET_MTU" || { log "eth0: MTU $SOFTROCE_NET_MTU refused"; bye 126; }
  ip link set eth0 up
  ip addr add "$SOFTROCE_NET_IP/24" dev eth0
  rdma link add rxe0 type rxe netdev eth0 || { log "rdma link add rxe0 failed"; bye 126; }
  devs=" rxe0"
else
  i=0
  while [ "$i" -lt "$SOFTROCE_RXE" ]; do
    ip link show "dummy$i" >/dev/null 2>&1 || ip link add "dummy$i" type dummy
    ip link set "dummy$i" mtu 1500 up
    ip addr add "192.0.2.$((i + 1))/24" dev "dummy$i"
    rdma link add "rxe$i" type rxe netdev "dummy$i" || { log "rdma link add rxe$i failed"; bye 126; }
    devs="$devs rxe$i"
    i=$((i + 1))
  done
fi
# The IPv4-mapped GID (index 1) shows up shortly after `rdma link add`.
for d in $devs; do
  n=0
  until g=$(cat "/sys/class/infiniband/$d/ports/1/gids/1" 2>/dev/null) && [ -n "$g" ] && \
        [ "$g" != "0000:0000:0000:0000:0000:0000:0000:0000" ]; do
    n=$((n + 1)); [ "$n" -gt 500 ] && { log "$d: no GID at index 1"; bye 126; }
    usleep 10000
  done
done
export SOFTROCE=1 SOFTROCE_DEVICES="${devs# }" SOFTROCE_GID_INDEX=1 SOFTROCE_IP=${SOFTROCE_NET_IP:-192.0.2.1}
[ -n "${SOFTROCE_NET_PEER:-}" ] && export SOFTROCE_PEER_IP="$SOFTROCE_NET_PEER" SOFTROCE_PAIR_ROLE SOFTROCE_NETDEV=eth0
log "rdma up:$(for d in $devs; do printf ' %s' "$(rdma link show "$d/1" | cut -d' ' -f2,4,8)"; done)"
if [ -n "${SOFTROCE_SHELL:-}" ]; then
  setsid cttyhack sh
  bye 0
fi
stty -F /dev/ttyS1 raw -echo 2>/dev/null
stty -F /dev/ttyS2 raw -echo 2>/dev/null
cd "$SOFTROCE_CWD" 2>/dev/null || cd /
sh /softroce/cmd </dev/null >/dev/ttyS1 2>/dev/ttyS2
rc=$?
log "done, exit code $rc"
bye "$rc"
INIT
}

# ------------------------------------------------------------------------------------ boot
STAGE=
stage_file() {  # copy a host file to the same absolute path in the stage
  local dst="$STAGE$1"
  mkdir -p "$(dirname "$dst")" && cp -L --preserve=mode "$1" "$dst"
}

in_guest() {  # is library basename $1 part of the image?
  local d
  for d in lib/x86_64-linux-gnu usr/lib/x86_64-linux-gnu lib64; do
    [[ -e "$CACHE/root/$d/$1" ]] && return 0
  done
  return 1
}

stage_exe() {
  local exe=$1 name arrow path rest
  # Debug info is most of a test binary (60-70 MB each with it): the guest unpacks the whole
  # initramfs into its RAM, and a dozen binaries with it no longer fit in 2 GiB. Symbols stay,
  # so backtraces in the guest still name functions. Stripped straight into the stage, so the
  # disk never holds a second full-size copy (CI hosts can be short of disk).
  mkdir -p "$(dirname "$STAGE$exe")" || die "cannot stage $exe"
  if ! { command -v strip >/dev/null && strip --strip-debug -o "$STAGE$exe" "$exe" 2>/dev/null; }; then
    stage_file "$exe" || die "cannot stage $exe$(disk_note "$STAGE")"
  fi
  while read -r name arrow path rest; do
    [[ "$arrow" == "=>" ]] || continue
    if [[ "$path" == not ]]; then say "warning: $exe needs $name, which the host lacks"; continue; fi
    in_guest "$(basename "$path")" || stage_file "$path"
  done < <(ldd "$exe" 2>/dev/null)
}

q() { printf "'%s'" "${1//\'/\'\\\'\'}"; }

# parse_programs MODE ARGS...: the programs of one VM (batch syntax: `:::` between programs;
# `run` takes one program and its arguments) into PLINES (shell-quoted command lines) and PNAMES.
PLINES=() PNAMES=()
parse_programs() {
  local mode=$1; shift
  PLINES=() PNAMES=()
  local line= want_exe=1 a e
  for a in "$@" :::; do
    if [[ "$a" == ::: && "$mode" != run ]]; then
      [[ -n "$line" ]] && PLINES+=("$line")
      line= want_exe=1
      continue
    fi
    if [[ -n "$want_exe" ]]; then
      e=$a
      [[ "$e" == */* ]] || e=$(command -v -- "$e") || die "not found: $a"
      e=$(realpath -- "$e") || die "not found: $a"
      [[ -f "$e" && -x "$e" ]] || die "not an executable: $e"
      stage_exe "$e"
      PNAMES+=("$(basename "$e")")
      line=$(q "$e") want_exe=
    elif [[ "$a" != ::: ]]; then
      line+=" $(q "$a")"
    fi
  done
  [[ "$mode" == run && -n "$line" ]] && PLINES+=("$line")
  [[ ${#PLINES[@]} -ge 1 ]] || die "no program to run"
}

# write_env FILE MARK [NAME=VALUE...]: the guest's /softroce/env.
write_env() {
  local file=$1 mark=$2; shift 2
  {
    echo "SOFTROCE_MARK=$mark"
    echo "SOFTROCE_RXE=$(q "${SOFTROCE_RXE:-1}")"
    echo "SOFTROCE_CWD=$(q "$PWD")"
    local kv
    for kv in "$@"; do echo "${kv%%=*}=$(q "${kv#*=}")"; done
    local k pass=" ${SOFTROCE_PASS_ENV:-} "
    for k in $(compgen -e); do
      case "$k" in
        RUST_*|CARGO_*|RPC_*) ;;
        SOFTROCE_CACHE|SOFTROCE_RXE|SOFTROCE_MARK|SOFTROCE_SHELL|SOFTROCE_CWD|SOFTROCE_NET*) continue ;;
        SOFTROCE_*) ;;
        *) [[ "$pass" == *" $k "* ]] || continue ;;
      esac
      echo "export $k=$(q "${!k}")"
    done
  } >"$file"
}

# write_batch FILE: the guest script running PLINES in turn (exit: the first failure's code).
write_batch() {
  local tt=${SOFTROCE_TEST_TIMEOUT:-600} n=${#PLINES[@]} i
  {
    echo 'first=0 failed=0'
    echo 'up() { cut -d" " -f1 /proc/uptime; }'
    for i in "${!PLINES[@]}"; do
      echo "echo \"=== softroce [$((i + 1))/$n] ${PNAMES[$i]} (guest t=\$(up)s)\" >&2"
      echo "timeout -s KILL $tt ${PLINES[$i]}; rc=\$?"
      echo "echo \"=== softroce [$((i + 1))/$n] ${PNAMES[$i]}: exit \$rc (guest t=\$(up)s)\" >&2"
      echo '[ $rc -ne 0 ] && { failed=$((failed + 1)); [ $first -eq 0 ] && first=$rc; }'
    done
    echo "echo \"=== softroce: $n programs, \$failed failed\" >&2"
  } >"$1"
}

# The `pair` control port: VM B tells VM A that its programs are done.
PAIR_DONE_PORT=7999

# write_servers FILE: VM A's script: every program of PLINES at once, in the background, with
# stdin from a FIFO that stays open until VM B reports (over TCP) that its programs are done;
# then the FIFO closes (the programs see EOF on stdin and finish) and each exit code is
# collected (bounded).
write_servers() {
  local tt=${SOFTROCE_TEST_TIMEOUT:-600} n=${#PLINES[@]} i
  {
    echo 'first=0 failed=0 pids='
    echo 'up() { cut -d" " -f1 /proc/uptime; }'
    echo 'mkfifo /tmp/softroce-ctl && exec 3<>/tmp/softroce-ctl'
    echo "timeout $tt nc -l -p $PAIR_DONE_PORT >/dev/null 3>&- </dev/null & done_pid=\$!"
    for i in "${!PLINES[@]}"; do
      echo "echo \"=== softroce-a [$((i + 1))/$n] ${PNAMES[$i]} starts (guest t=\$(up)s)\" >&2"
      echo "timeout -s KILL $tt ${PLINES[$i]} </tmp/softroce-ctl 3>&- & pids=\"\$pids \$!\""
    done
    echo 'wait $done_pid'
    echo 'echo "=== softroce-a: the client VM is done (guest t=$(up)s); closing stdin" >&2'
    echo 'exec 3>&-'
    echo 'i=0; for p in $pids; do i=$((i + 1)); wait $p; rc=$?'
    echo "  echo \"=== softroce-a [\$i/$n]: exit \$rc (guest t=\$(up)s)\" >&2"
    echo '  [ $rc -ne 0 ] && { failed=$((failed + 1)); [ $first -eq 0 ] && first=$rc; }'
    echo 'done'
    echo "echo \"=== softroce-a: $n programs, \$failed failed\" >&2"
    echo 'exit $first'
  } >"$1"
}

# boot MODE ARGS...: MODE is run (one program and its arguments), batch (programs and their
# arguments separated by `:::`), shell, or pair (VM A's programs, `--vm-b`, VM B's programs).
boot() {
  local mode=$1; shift
  prepare
  local work
  work=$(mktemp -d "${TMPDIR:-/tmp}/softroce.XXXXXX") || die "mktemp failed"
  # shellcheck disable=SC2064
  trap "rm -rf '$work'" EXIT
  STAGE="$work/stage" WORK=$work
  mkdir -p "$STAGE/softroce" "$STAGE$PWD"

  local tt=${SOFTROCE_TEST_TIMEOUT:-600} a
  local args_a=() args_b=() seen_b=
  if [[ "$mode" == pair ]]; then
    for a in "$@"; do
      if [[ "$a" == --vm-b && -z "$seen_b" ]]; then seen_b=1; continue; fi
      if [[ -n "$seen_b" ]]; then args_b+=("$a"); else args_a+=("$a"); fi
    done
    [[ -n "$seen_b" ]] || die "pair: VM B's programs follow --vm-b"
  fi

  local x
  for x in ${SOFTROCE_EXTRA:-}; do
    if [[ -d "$x" ]]; then x=$(realpath "$x"); mkdir -p "$STAGE$x"; cp -a "$x/." "$STAGE$x/"
    elif [[ -f "$x" && -x "$x" ]]; then stage_exe "$(realpath "$x")"
    elif [[ -e "$x" ]]; then stage_file "$(realpath "$x")"
    else say "warning: SOFTROCE_EXTRA entry $x does not exist"; fi
  done

  if [[ "$mode" != pair ]]; then
    parse_programs "$mode" "$@"
    local mark
    mark=$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')
    local extra_env=()
    [[ "$mode" == shell ]] && extra_env+=(SOFTROCE_SHELL=1)
    write_env "$STAGE/softroce/env" "$mark" "${extra_env[@]}"
    if [[ "$mode" != batch ]]; then
      echo "exec timeout -s KILL $tt ${PLINES[0]}" >"$STAGE/softroce/cmd"
    else
      write_batch "$STAGE/softroce/cmd"
      echo 'exit $first' >>"$STAGE/softroce/cmd"
    fi
    cp "$CACHE/base.cpio" "$work/initrd" || die "cannot copy the base image$(disk_note "$work")"
    pack_run "$work/initrd"
    launch "$work" x "$work/initrd" "$mode" -nic none
    finish_vm x
    exit "$VM_RC"
  fi

  # pair: two VMs, one virtio NIC each, joined by a qemu stream netdev over a unix socket
  # (an Ethernet cable between them: nothing else is on it, and the host has no address on it).
  local mtu=${SOFTROCE_NET_MTU:-9000} mtu_b=${SOFTROCE_NET_MTU_B:-${SOFTROCE_NET_MTU:-9000}}
  parse_programs batch "${args_a[@]}"
  write_servers "$work/cmd-a"
  local names_a=("${PNAMES[@]}")
  parse_programs batch "${args_b[@]}"
  write_batch "$work/cmd-b"
  {
    echo "n=0; until echo done | timeout 10 nc $PAIR_IP_A $PAIR_DONE_PORT >/dev/null 2>&1; do"
    echo '  n=$((n + 1)); [ $n -ge 30 ] && { echo "=== softroce-b: cannot tell VM A that we are done" >&2; break; }; sleep 1'
    echo 'done'
    echo 'exit $first'
  } >>"$work/cmd-b"
  : >"$work/run.cpio"
  pack_run "$work/run.cpio"
  local side mark_a mark_b
  mark_a=$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')
  mark_b=$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')
  for side in a b; do
    local s="$work/side-$side"
    mkdir -p "$s/softroce"
    cp "$work/cmd-$side" "$s/softroce/cmd"
    if [[ $side == a ]]; then
      write_env "$s/softroce/env" "$mark_a" SOFTROCE_NET=virtio SOFTROCE_NET_IP=$PAIR_IP_A \
        SOFTROCE_NET_PEER=$PAIR_IP_B SOFTROCE_NET_MTU="$mtu" SOFTROCE_PAIR_ROLE=a
    else
      write_env "$s/softroce/env" "$mark_b" SOFTROCE_NET=virtio SOFTROCE_NET_IP=$PAIR_IP_B \
        SOFTROCE_NET_PEER=$PAIR_IP_A SOFTROCE_NET_MTU="$mtu_b" SOFTROCE_PAIR_ROLE=b
    fi
    (cd "$s" && find . | "$CACHE/busybox" cpio -o -H newc -R 0:0 2>/dev/null) >"$work/$side.cpio" ||
      die "packing VM $side's archive failed$(disk_note "$work")"
    cat "$CACHE/base.cpio" "$work/run.cpio" "$work/$side.cpio" >"$work/initrd-$side" ||
      die "writing VM $side's initramfs failed$(disk_note "$work")"
  done
  rm -f "$work/run.cpio" "$work/a.cpio" "$work/b.cpio"
  local sock="$work/link.sock"
  say "pair: VM A ($PAIR_IP_A, ${names_a[*]}) <-> VM B ($PAIR_IP_B, ${PNAMES[*]}), MTU $mtu/$mtu_b"
  launch "$work" a "$work/initrd-a" pair \
    -netdev "stream,id=n0,server=on,addr.type=unix,addr.path=$sock" \
    -device "virtio-net-pci,netdev=n0,mac=52:54:00:00:02:01"
  local n=0
  until [[ -S "$sock" ]]; do
    n=$((n + 1)); [[ $n -gt 300 ]] && die "pair: VM A's qemu did not open $sock"
    kill -0 "${VM_PID[a]}" 2>/dev/null || die "pair: VM A's qemu exited at start"
    sleep 0.1
  done
  launch "$work" b "$work/initrd-b" pair \
    -netdev "stream,id=n0,server=off,addr.type=unix,addr.path=$sock" \
    -device "virtio-net-pci,netdev=n0,mac=52:54:00:00:02:02"
  finish_vm b
  local rc_b=$VM_RC
  # VM A ends when VM B's done message reaches it; give it a bounded grace period.
  local grace=${SOFTROCE_PAIR_GRACE:-120}
  n=0
  while kill -0 "${VM_PID[a]}" 2>/dev/null && [[ $n -lt $((grace * 10)) ]]; do sleep 0.1; n=$((n + 1)); done
  if kill -0 "${VM_PID[a]}" 2>/dev/null; then
    say "pair: VM A did not finish within ${grace} s after VM B; stopping it"
    kill -TERM "${VM_PID[a]}" 2>/dev/null
  fi
  finish_vm a
  local rc_a=$VM_RC
  say "pair: VM A exit $rc_a, VM B exit $rc_b"
  [[ $rc_b -ne 0 ]] && exit "$rc_b"
  exit "$rc_a"
}

PAIR_IP_A=192.0.2.1
PAIR_IP_B=192.0.2.2

# pack_run FILE: appends the staged programs and files to FILE as a newc archive (the kernel
# unpacks concatenated archives in order), then drops the staged programs, so that only one
# copy is on disk (softroce/env stays: finish_vm reads the run's mark from it).
pack_run() {
  (cd "$STAGE" && find . | "$CACHE/busybox" cpio -o -H newc -R 0:0 2>/dev/null) >>"$1" ||
    die "packing the run archive failed$(disk_note "$(dirname "$1")")"
  find "$STAGE" -mindepth 1 -maxdepth 1 ! -name softroce -exec rm -rf {} +
}

# disk_note DIR: what a failed write most likely ran into, for its error message.
disk_note() {
  local staged free
  staged=$(du -sh "$STAGE" 2>/dev/null | cut -f1)
  free=$(df -h "$1" 2>/dev/null | tail -1 | awk '{print $4 " free of " $2}')
  printf ' (stage: %s; disk at %s: %s; likely cause: the disk is full)' \
    "${staged:-gone}" "$1" "${free:-unknown}"
}

WORK=
declare -A VM_PID VM_CATS VM_MODE VM_MARK_FILE
VM_RC=0
INTERRUPTED=

# launch WORK NAME INITRD MODE QEMU-NET-ARGS...: starts one VM in the background; its program
# output streams to our stdout/stderr (prefixed with `[NAME] ` in pair mode).
launch() {
  local work=$1 name=$2 initrd=$3 mode=$4; shift 4
  local accel=${SOFTROCE_ACCEL:-tcg}
  if [[ "$accel" == auto ]]; then
    # PVM hosts (kvm_pvm) open /dev/kvm but run a stock guest kernel far slower than TCG.
    if [[ -w /dev/kvm && ! -d /sys/module/kvm_pvm ]] && grep -qwE 'vmx|svm' /proc/cpuinfo; then
      accel=kvm
    else
      accel=tcg
    fi
  fi
  local acc=(-accel tcg,thread=multi -cpu max)
  [[ "$accel" == kvm ]] && acc=(-accel kvm -cpu host,-arch-capabilities)
  local kernel="$CACHE/vmlinux"
  [[ -f "$kernel" ]] || kernel="$CACHE/vmlinuz"
  # initcall_blacklist: a crypto self-test and kprobe-trace setup, ~1 s under TCG, unused.
  local cmdline="console=ttyS0 quiet loglevel=3 panic=-1 oops=panic rdinit=/init tsc=reliable"
  cmdline+=" nokaslr mitigations=off 8250.nr_uarts=3 i8042.noaux i8042.nokbd"
  cmdline+=" initcall_blacklist=crypto_kdf108_init,init_kprobe_trace"

  # Program output: guest serial ports -> FIFOs -> cat (or sed) processes holding our own
  # stdout and stderr, so it streams live to whatever they are (tty, pipe or file).
  local d="$work/vm-$name"
  mkdir -p "$d"
  mkfifo "$d/out" "$d/err"
  local c1 c2
  if [[ "$mode" == pair ]]; then
    sed -u "s/^/[$name] /" "$d/out" & c1=$!
    sed -u "s/^/[$name] /" "$d/err" >&2 & c2=$!
  else
    cat "$d/out" & c1=$!
    cat "$d/err" >&2 & c2=$!
  fi
  VM_CATS[$name]="$c1 $c2"
  VM_MODE[$name]=$mode
  local serial0=(-serial "file:$d/console")
  exec 5</dev/null
  if [[ "$mode" == shell ]]; then serial0=(-serial stdio); exec 5<&0; fi

  timeout -k 5 "${SOFTROCE_TIMEOUT:-900}" qemu-system-x86_64 "${acc[@]}" -M q35 \
    -m "${SOFTROCE_MEM:-2048M}" -smp "${SOFTROCE_SMP:-2}" \
    -nodefaults -no-reboot -display none -vga none "$@" \
    -kernel "$kernel" -initrd "$initrd" -append "$cmdline" \
    "${serial0[@]}" \
    -chardev "file,id=out,path=$d/out" -serial chardev:out \
    -chardev "file,id=err,path=$d/err" -serial chardev:err <&5 &
  VM_PID[$name]=$!
  trap 'INTERRUPTED=1; for p in "${VM_PID[@]}"; do kill -TERM $p 2>/dev/null; done' INT TERM HUP
}

# finish_vm NAME: waits for that VM and sets VM_RC to its program's exit code.
finish_vm() {
  local name=$1
  local d="$WORK/vm-$name"
  local qpid=${VM_PID[$name]} qrc
  wait "$qpid"; qrc=$?
  while kill -0 "$qpid" 2>/dev/null; do wait "$qpid"; qrc=$?; done
  # If qemu died before opening the FIFOs, their readers still wait in open(): give each a
  # writer that closes at once.
  local _ c ok
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    ok=1
    for c in ${VM_CATS[$name]}; do kill -0 "$c" 2>/dev/null && ok=; done
    [[ -n "$ok" ]] && break
    exec 6<>"$d/out" 7<>"$d/err"; exec 6>&- 7>&-
    sleep 0.1
  done
  # shellcheck disable=SC2086
  wait ${VM_CATS[$name]} 2>/dev/null

  [[ -n "$INTERRUPTED" ]] && { say "interrupted; VM stopped"; exit 130; }
  [[ "${VM_MODE[$name]}" == shell ]] && exit "$qrc"
  local rc mark
  mark=$(sed -n 's/^SOFTROCE_MARK=//p' "$STAGE/softroce/env" 2>/dev/null)
  [[ "${VM_MODE[$name]}" == pair ]] && mark=$(sed -n 's/^SOFTROCE_MARK=//p' "$WORK/side-$name/softroce/env")
  rc=$(sed -n "s/^SOFTROCE_RC_${mark}=\([0-9]*\).*/\1/p" "$d/console" 2>/dev/null | tail -1)
  local tag=
  [[ "${VM_MODE[$name]}" == pair ]] && tag=" (VM $name)"
  if [[ -n "${SOFTROCE_VERBOSE:-}" || -z "$rc" || "$rc" == 126 ]]; then
    say "----- guest console$tag -----"
    cat "$d/console" >&2 2>/dev/null
    say "----- end of guest console$tag -----"
  fi
  if [[ -z "$rc" ]]; then
    if [[ $qrc -eq 124 || $qrc -eq 137 ]]; then
      say "VM$tag timed out after ${SOFTROCE_TIMEOUT:-900} s"; VM_RC=124; return
    fi
    say "the guest$tag did not report an exit code (qemu exit $qrc)"; VM_RC=125; return
  fi
  VM_RC=$rc
}

usage() {
  sed -n '2,/^set -uo/p' "$SELF" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit 2
}

cmd=${1:-}
[[ $# -gt 0 ]] && shift
case "$cmd" in
  prepare) prepare; say "image: $CACHE (recipe $RECIPE)"; exit 0 ;;
  run) [[ $# -ge 1 ]] || usage; boot run "$@" ;;
  batch) [[ $# -ge 1 ]] || usage; boot batch "$@" ;;
  pair) [[ $# -ge 1 ]] || usage; boot pair "$@" ;;
  shell) boot shell /bin/true ;;
  *) usage ;;
esac
