//! The soft provider's fast path makes no system call: after a warm-up, a forked child
//! installs a seccomp filter that kills it on any system call except its final report, then
//! runs `post_recv`, `post_send` (every opcode) and `poll` on both sides of a connection.
//! Killed by SIGSYS = a system call on the fast path.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![cfg(all(target_os = "linux", target_arch = "x86_64"))]

use std::time::{Duration, Instant};

use rpc_core::verbs::soft::Soft;
use rpc_core::verbs::{
    Access, ConnectAttr, Context, Cq, Mr, Pd, Provider, Qp, QpCaps, RecvWr, SendFlags, SendWr, Wc,
    WcStatus, WrOp,
};

const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;

fn stmt(code: u32, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jeq(k: u32, jt: u8, jf: u8) -> libc::sock_filter {
    libc::sock_filter {
        code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
        jt,
        jf,
        k,
    }
}

/// Allows `exit`, `exit_group` and `write(report_fd, ..)`; kills the process otherwise.
fn install_filter(report_fd: i32) -> bool {
    let ld = libc::BPF_LD | libc::BPF_W | libc::BPF_ABS;
    let ret = libc::BPF_RET | libc::BPF_K;
    let filter = [
        stmt(ld, 4), // arch
        jeq(AUDIT_ARCH_X86_64, 1, 0),
        stmt(ret, libc::SECCOMP_RET_KILL_PROCESS),
        stmt(ld, 0), // syscall number
        jeq(libc::SYS_exit_group as u32, 4, 0),
        jeq(libc::SYS_exit as u32, 3, 0),
        jeq(libc::SYS_write as u32, 0, 3),
        stmt(ld, 16), // args[0], low half
        jeq(report_fd as u32, 0, 1),
        stmt(ret, libc::SECCOMP_RET_ALLOW),
        stmt(ret, libc::SECCOMP_RET_KILL_PROCESS),
    ];
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr().cast_mut(),
    };
    // SAFETY: plain prctl calls; `prog` and `filter` outlive the second call, which copies
    // the program into the kernel.
    unsafe {
        libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
            && libc::prctl(
                libc::PR_SET_SECCOMP,
                libc::SECCOMP_MODE_FILTER as libc::c_ulong,
                &raw const prog,
            ) == 0
    }
}

/// Polls `n` successful completions with a bounded spin (no clock: reading it could be a
/// system call on some virtual machines).
fn poll_exact<C: Cq>(cq: &mut C, n: usize) -> Result<(), &'static [u8]> {
    let mut wcs = [Wc::default(); 16];
    let mut got = 0;
    let mut spins = 0u64;
    while got < n {
        let k = cq
            .poll(&mut wcs[..(n - got).min(16)])
            .map_err(|_| &b"poll"[..])?;
        if wcs[..k].iter().any(|w| w.status != WcStatus::Success) {
            return Err(b"status");
        }
        got += k;
        spins += 1;
        if spins > 100_000_000 {
            return Err(b"timeout");
        }
    }
    Ok(())
}

/// Forks; the child installs the filter and runs `body`, then exits 0. Returns the child's
/// wait status and what it reported.
fn in_filtered_child(body: impl FnOnce() -> Result<(), &'static [u8]>) -> (i32, String) {
    let mut fds = [0i32; 2];
    // SAFETY: `fds` is a valid out-array of two ints.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: the child only runs `body` (code that neither allocates nor locks) and leaves
    // with exit_group; it never returns into the test harness.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let report = |msg: &[u8]| -> ! {
            // SAFETY: write from a valid buffer, then leave the process at once.
            unsafe {
                libc::write(fds[1], msg.as_ptr().cast(), msg.len());
                libc::syscall(libc::SYS_exit_group, 0);
            }
            unreachable!()
        };
        if !install_filter(fds[1]) {
            report(b"no seccomp");
        }
        match body() {
            Ok(()) => report(b"ok"),
            Err(e) => report(e),
        }
    }
    // SAFETY: closing our copy of the write end, which we own.
    unsafe { libc::close(fds[1]) };
    let t0 = Instant::now();
    let mut status = 0;
    loop {
        // SAFETY: `status` is a valid out-pointer.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            break;
        }
        if t0.elapsed() > Duration::from_secs(30) {
            // SAFETY: killing the child we forked.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("the child did not finish");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut buf = [0u8; 32];
    // SAFETY: reads into a valid buffer from the read end we own.
    let n = unsafe { libc::read(fds[0], buf.as_mut_ptr().cast(), buf.len()) };
    // SAFETY: closing the read end we own.
    unsafe { libc::close(fds[0]) };
    (
        status,
        String::from_utf8_lossy(&buf[..n.max(0) as usize]).into_owned(),
    )
}

fn killed_by_sigsys(status: i32) -> bool {
    libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSYS
}

#[test]
fn fast_path_makes_no_system_call() {
    // Control: under the filter, one system call is fatal.
    let (status, msg) = in_filtered_child(|| {
        // SAFETY: getppid has no preconditions.
        unsafe { libc::getppid() };
        Ok(())
    });
    if msg == "no seccomp" {
        eprintln!("skipping: seccomp filters are not available here");
        return;
    }
    assert!(
        killed_by_sigsys(status),
        "the filter let getppid through: {status:#x} {msg}"
    );

    let a_ctx = Soft::open(None).unwrap();
    let b_ctx = Soft::open(None).unwrap();
    let (a_pd, b_pd) = (a_ctx.alloc_pd().unwrap(), b_ctx.alloc_pd().unwrap());
    let mut a_cq = a_ctx.create_cq(512, None).unwrap();
    let mut b_cq = b_ctx.create_cq(512, None).unwrap();
    let caps = QpCaps {
        max_send_wr: 64,
        max_recv_wr: 64,
        max_send_sge: 4,
        max_recv_sge: 4,
        max_inline_data: 128,
    };
    let attr = ConnectAttr::default();
    let mut a = a_pd.create_qp(&a_cq, &a_cq, caps).unwrap();
    let mut b = b_pd.create_qp(&b_cq, &b_cq, caps).unwrap();
    a.modify_to_init(attr.access).unwrap();
    b.modify_to_init(attr.access).unwrap();
    let (ea, eb) = (a.endpoint(), b.endpoint());
    a.connect(&eb, &attr).unwrap();
    b.connect(&ea, &attr).unwrap();
    let src = a_pd.alloc_mr(1 << 16, Access::ALL).unwrap();
    let dst = b_pd.alloc_mr(1 << 16, Access::ALL).unwrap();
    let r = dst.remote();
    let s1 = [src.sge(0, 100).unwrap(), src.sge(4096, 900).unwrap()];
    let s8 = [src.sge(8192, 8).unwrap()];
    let recv_sge = [dst.sge(16384, 4096).unwrap()];
    let recvs = [RecvWr {
        wr_id: 7,
        sg_list: &recv_sge,
    }; 3];
    let sig = SendFlags::SIGNALED;
    let wr = |wr_id, op, sg_list, flags| SendWr {
        wr_id,
        op,
        sg_list,
        flags,
    };
    let wrs = [
        wr(1, WrOp::Send, &s1[..], sig),
        wr(
            2,
            WrOp::SendWithImm { imm: 5 },
            &s8[..],
            sig | SendFlags::INLINE,
        ),
        wr(
            3,
            WrOp::Write {
                remote_addr: r.addr,
                rkey: r.rkey,
            },
            &s1[..],
            SendFlags::NONE,
        ),
        wr(
            4,
            WrOp::WriteWithImm {
                remote_addr: r.addr + 2048,
                rkey: r.rkey,
                imm: 6,
            },
            &s1[..],
            sig,
        ),
        wr(
            5,
            WrOp::Read {
                remote_addr: r.addr,
                rkey: r.rkey,
            },
            &s1[..],
            sig,
        ),
        wr(
            6,
            WrOp::FetchAdd {
                remote_addr: r.addr + 8192,
                rkey: r.rkey,
                add: 1,
            },
            &s8[..],
            sig,
        ),
        wr(
            8,
            WrOp::CompareSwap {
                remote_addr: r.addr + 8192,
                rkey: r.rkey,
                compare: 0,
                swap: 1,
            },
            &s8[..],
            sig,
        ),
    ];
    let mut round = |a: &mut <Soft as Provider>::Qp,
                     b: &mut <Soft as Provider>::Qp|
     -> Result<(), &'static [u8]> {
        // SAFETY: the regions outlive every completion, polled below.
        unsafe {
            b.post_recv(&recvs).map_err(|_| &b"post_recv"[..])?;
            a.post_send(&wrs).map_err(|_| &b"post_send"[..])?;
        }
        poll_exact(&mut a_cq, 6)?;
        poll_exact(&mut b_cq, 3)
    };
    // Warm-up: maps the peer's regions (system calls, once).
    for _ in 0..3 {
        round(&mut a, &mut b).unwrap();
    }

    let (status, msg) = in_filtered_child(|| {
        for _ in 0..200 {
            round(&mut a, &mut b)?;
        }
        Ok(())
    });
    assert!(
        !killed_by_sigsys(status),
        "killed by SIGSYS: a system call on the fast path"
    );
    assert!(libc::WIFEXITED(status), "child status {status:#x}");
    assert_eq!(msg, "ok");
}
