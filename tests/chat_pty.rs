//! `tandem chat` in a pseudo-terminal: prompt marks, a streamed reply with its summary line, Ctrl-C that
//! stops a reply (and at the prompt) without ending the session, /reset and /exit. Every wait is bounded.
#![cfg(target_os = "linux")]

mod common;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::fixture_dir;

struct Pty {
    master: OwnedFd,
    child: Child,
    seen: Vec<u8>,
    /// Output before this offset has been matched already.
    pos: usize,
}

impl Pty {
    /// `None` (after saying so) where the system has no pseudo-terminals to give.
    fn spawn(args: &[&str], env: &[(&str, &str)]) -> Option<Pty> {
        let (mut master, mut slave) = (0, 0);
        // SAFETY: both out-pointers are valid c_ints; name, termios and winsize may be null.
        let rc =
            unsafe { libc::openpty(&mut master, &mut slave, std::ptr::null_mut(), std::ptr::null(), std::ptr::null()) };
        if rc != 0 {
            eprintln!("skipped: openpty failed: {}", std::io::Error::last_os_error());
            return None;
        }
        // SAFETY: openpty succeeded, so both are open descriptors that nothing else owns.
        let master = unsafe { OwnedFd::from_raw_fd(master) };
        let slave = unsafe { OwnedFd::from_raw_fd(slave) };
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem"));
        cmd.args(args)
            .envs(env.iter().copied())
            .env("TERM", "xterm")
            .stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            .stderr(Stdio::from(slave.try_clone().unwrap()));
        // SAFETY: the hook runs in the forked child before exec and calls only async-signal-safe
        // functions (setsid, ioctl); it allocates nothing and touches no locks.
        unsafe {
            cmd.pre_exec(|| {
                // A session of its own with the pty as controlling terminal, so that ^C becomes SIGINT.
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY as _, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("spawn tandem chat");
        drop(cmd);
        drop(slave);
        Some(Pty { master, child, seen: Vec::new(), pos: 0 })
    }

    /// Read whatever arrives within `wait`; false at end of output.
    fn read_some(&mut self, wait: Duration) -> bool {
        let mut pfd = libc::pollfd { fd: self.master.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: `pfd` is one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, wait.as_millis() as libc::c_int) };
        if n <= 0 {
            return true;
        }
        let mut buf = [0u8; 4096];
        // SAFETY: `buf` is writable for `buf.len()` bytes; the descriptor is owned by `self.master`.
        let got = unsafe { libc::read(self.master.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if got <= 0 {
            return false; // EIO once the child has closed the terminal
        }
        self.seen.extend_from_slice(&buf[..got as usize]);
        true
    }

    /// Wait (at most `timeout`) for `needle` in the output after what was matched before; returns the text
    /// up to and including it.
    fn expect(&mut self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(j) = find_bytes(&self.seen, needle.as_bytes(), self.pos) {
                let upto = String::from_utf8_lossy(&self.seen[self.pos..j + needle.len()]).into_owned();
                self.pos = j + needle.len();
                return upto;
            }
            let now = Instant::now();
            assert!(now < deadline, "timed out waiting for {needle:?}; output so far: {:?}", self.rest());
            if !self.read_some((deadline - now).min(Duration::from_millis(100))) {
                assert!(
                    find_bytes(&self.seen, needle.as_bytes(), self.pos).is_some(),
                    "output ended before {needle:?}: {:?}",
                    self.rest()
                );
            }
        }
    }

    /// Wait until `n` more bytes arrived after what was matched.
    fn wait_for_bytes(&mut self, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.seen.len() < self.pos + n {
            assert!(Instant::now() < deadline, "timed out waiting for output; got {:?}", self.rest());
            assert!(self.read_some(Duration::from_millis(50)), "output ended: {:?}", self.rest());
        }
    }

    fn rest(&self) -> String {
        String::from_utf8_lossy(&self.seen[self.pos..]).into_owned()
    }

    fn send(&mut self, s: &str) {
        // SAFETY: `s` is readable for `s.len()` bytes; the descriptor is owned by `self.master`.
        let n = unsafe { libc::write(self.master.as_raw_fd(), s.as_ptr().cast(), s.len()) };
        assert_eq!(n, s.len() as isize, "write to the pty");
    }

    fn wait_exit(&mut self, timeout: Duration) -> i32 {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code().unwrap_or(-1);
            }
            assert!(Instant::now() < deadline, "tandem chat did not exit");
            self.read_some(Duration::from_millis(50));
        }
    }
}

impl Drop for Pty {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn find_bytes(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    (from..=hay.len().saturating_sub(needle.len())).find(|&i| hay[i..].starts_with(needle))
}

const T: Duration = Duration::from_secs(20);

#[test]
fn chat_session_in_a_terminal() {
    let model = fixture_dir("text-tiny").display().to_string();
    let Some(mut pty) =
        Pty::spawn(&["chat", "--model", &model, "--max-new-tokens", "10", "--system", "Be brief."], &[])
    else {
        return;
    };
    pty.expect("Ctrl-C stops a reply", T);
    pty.expect("> ", T);
    pty.send("Hello\r");
    let reply = pty.expect(" tokens, ", T);
    assert!(reply.contains("Hello"), "the typed line is echoed: {reply:?}");
    pty.expect("tok/s; prompt ", T);
    pty.expect("> ", T);
    // Ctrl-C at the prompt: a hint, and the session goes on.
    pty.send("\x03");
    pty.expect("Ctrl-C stops a reply", T);
    pty.expect("> ", T);
    pty.send("/reset\r");
    pty.expect("(conversation cleared)", T);
    pty.expect("> ", T);
    pty.send("/exit\r");
    assert_eq!(pty.wait_exit(T), 0);
}

#[test]
fn ctrl_c_stops_a_reply_but_not_the_session() {
    let model = fixture_dir("text-tiny").display().to_string();
    let assistant = fixture_dir("text-tiny-assistant").display().to_string();
    // 400 tokens at 25 ms each would take 10 s; Ctrl-C ends the reply at once.
    let Some(mut pty) = Pty::spawn(
        &["chat", "--model", &model, "--assistant", &assistant, "--max-new-tokens", "400", "--ignore-eos"],
        &[("TANDEM_TEST_TOKEN_DELAY_MS", "25")],
    ) else {
        return;
    };
    pty.expect("> ", T);
    pty.send("Tell me everything\r");
    pty.expect("Tell me everything\r\n", T);
    pty.wait_for_bytes(4, T); // the reply has started
    let t0 = Instant::now();
    pty.send("\x03");
    let summary = pty.expect("; interrupted]", T);
    assert!(t0.elapsed() < Duration::from_secs(5), "the reply did not stop promptly");
    assert!(summary.contains("drafts accepted"), "{summary:?}");
    // Still alive: another turn works, then end of input (Ctrl-D) quits.
    pty.expect("> ", T);
    pty.send("/help\r");
    pty.expect("/reset starts over", T);
    pty.expect("> ", T);
    pty.send("\x04");
    assert_eq!(pty.wait_exit(T), 0);
}
