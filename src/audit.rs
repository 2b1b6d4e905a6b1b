//! The audit trail's writer: one JSON line per event, written by a thread
//! of its own from a bounded buffer, so no request waits for a disk.
//!
//! The edges build the events ([`crate::api::audit`], and the
//! authentication layer for the calls it refuses) and hand them to
//! [`record`]: it formats the line and queues it. The writer thread polls
//! the queue (a request never wakes it: [`TICK`]) and writes what it takes
//! through one buffer, flushed about 10 ms after a line entered it
//! ([`LINGER`]; up to 50 ms after a quiet spell), so under load one
//! `write(2)` carries many lines.
//!
//! When the buffer is full (the output is slower than the requests), the
//! operator's choice ([`WhenFull`]) decides: `block` (the default) makes
//! the request that found it full wait for room, so the trail stays whole
//! and the service slows to the output's pace; `drop` loses the event and
//! goes on. Either is counted: `atmost_audit_events_delayed_total` and
//! `atmost_audit_events_dropped_total`, beside the lines the output refused
//! (`atmost_audit_write_errors_total`, also logged). The events of calls
//! the authentication layer refused never wait ([`record_refusal`]). At
//! exit, events not written out are reported with their number. Nothing
//! is lost silently.
//!
//! One trail per process, installed by `main` ([`install`]); where none is
//! installed (a server run in process by a test) the trail is off and an
//! event costs one atomic load.

use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::time::Duration;

/// The tracing target the trail's lines name (`"target"`), as when it was
/// written through the logs: what a pipeline reading both streams keys on.
pub const TARGET: &str = "atmost::audit";

/// Where the trail goes (`--audit-log`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    Stderr,
    Stdout,
    /// Appended to (created if missing).
    File(PathBuf),
    /// No trail: nothing is formatted.
    Off,
}

impl std::str::FromStr for Output {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        Ok(match text {
            "stderr" => Self::Stderr,
            "stdout" => Self::Stdout,
            "off" => Self::Off,
            "" => return Err("empty: stderr, stdout, off or a file's path".into()),
            path => Self::File(PathBuf::from(path)),
        })
    }
}

/// What an event does when the buffer is full (`--audit-when-full`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WhenFull {
    /// The request waits for room: the trail stays whole, the service
    /// slows to the output's pace.
    Block,
    /// The event is lost: the service goes on at its own pace.
    Drop,
}

/// The trail's settings.
#[derive(Debug, Clone)]
pub struct Config {
    pub output: Output,
    /// Lines the buffer holds before [`WhenFull`] applies.
    pub buffer_lines: usize,
    pub when_full: WhenFull,
}

/// One event, as [`record`] writes it (after `timestamp` and `target`).
/// The caller's values are already percent-encoded where they are the
/// caller's ([`crate::api::audit`]).
#[derive(Debug, Default, Serialize)]
pub struct Event<'a> {
    pub rpc: &'a str,
    pub key_id: &'a str,
    pub tenant: &'a str,
    pub permit_id: &'a str,
    pub tool: &'a str,
    pub idempotency_key: &'a str,
    pub outcome: &'a str,
    pub attempt_id: &'a str,
}

/// What the writer thread is sent.
enum Msg {
    Line(Vec<u8>),
    /// Answer, once everything sent before is written out, whether it was.
    Flush(SyncSender<bool>),
}

struct Trail {
    queue: SyncSender<Msg>,
    when_full: WhenFull,
    counts: &'static Counts,
}

/// The trail's counters, for the metrics. Every event handed to the trail
/// ends in exactly one of `written`, `dropped` and `write_errors`, or is
/// still queued.
#[derive(Debug, Default)]
pub struct Counts {
    /// Events queued.
    pub queued: AtomicU64,
    /// Lines the output took.
    pub written: AtomicU64,
    /// Events that found the buffer full and waited for room (`block`).
    pub delayed: AtomicU64,
    /// Events lost to a full buffer (`drop`, and refusals in either mode).
    pub dropped: AtomicU64,
    /// Lines the output refused (a full disk, a closed pipe): lost.
    pub write_errors: AtomicU64,
}

impl Counts {
    /// Events queued and not (yet) written out or lost to a write error.
    pub fn unwritten(&self) -> u64 {
        let done = self.written.load(Ordering::Relaxed) + self.write_errors.load(Ordering::Relaxed);
        self.queued.load(Ordering::Relaxed).saturating_sub(done)
    }
}

static TRAIL: OnceLock<Trail> = OnceLock::new();
static COUNTS: Counts = Counts {
    queued: AtomicU64::new(0),
    written: AtomicU64::new(0),
    delayed: AtomicU64::new(0),
    dropped: AtomicU64::new(0),
    write_errors: AtomicU64::new(0),
};

/// Opens the output and starts the writer thread (once per process: a
/// second call is an error). With [`Output::Off`] nothing is started and
/// the trail stays off.
pub fn install(config: &Config) -> Result<(), String> {
    let out: Box<dyn Write + Send> = match &config.output {
        Output::Off => return Ok(()),
        Output::Stderr => Box::new(std::io::stderr()),
        Output::Stdout => Box::new(std::io::stdout()),
        Output::File(path) => Box::new(open(path)?),
    };
    if config.buffer_lines == 0 {
        return Err("--audit-buffer: at least 1 line".into());
    }
    let (queue, lines) = std::sync::mpsc::sync_channel(config.buffer_lines);
    let trail = Trail {
        queue,
        when_full: config.when_full,
        counts: &COUNTS,
    };
    TRAIL
        .set(trail)
        .map_err(|_| "the audit trail is already installed".to_owned())?;
    std::thread::Builder::new()
        .name("atmost-audit".into())
        .spawn(move || write_all(lines, out, &COUNTS))
        .map_err(|e| format!("starting the audit writer: {e}"))?;
    Ok(())
}

/// Opens `path` for appending, creating it: `--audit-log PATH`, checked
/// when the trail is installed, before the server binds.
pub fn open(path: &std::path::Path) -> Result<std::fs::File, String> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| format!("--audit-log {}: {e}", path.display()))
}

/// Whether a trail is installed: when not, callers skip building events.
pub fn enabled() -> bool {
    TRAIL.get().is_some()
}

/// The counters (zero while no trail is installed).
pub fn counts() -> &'static Counts {
    &COUNTS
}

/// Queues one event's line, as the trail's [`WhenFull`] says when the
/// buffer is full. Nothing when no trail is installed.
pub fn record(event: &Event<'_>) {
    if let Some(trail) = TRAIL.get() {
        queue(trail, event, trail.when_full);
    }
}

/// [`record`] for a call the authentication layer refused (no key, a bad
/// one, a role not allowed): never waits for room, whatever
/// `--audit-when-full` says. A flood of such calls cannot slow the
/// service through the trail; with the buffer full their events are lost,
/// and counted as dropped.
pub fn record_refusal(event: &Event<'_>) {
    if let Some(trail) = TRAIL.get() {
        queue(trail, event, WhenFull::Drop);
    }
}

fn queue(trail: &Trail, event: &Event<'_>, when_full: WhenFull) {
    let line = line(event, std::time::SystemTime::now());
    let counts = trail.counts;
    match trail.queue.try_send(Msg::Line(line)) {
        Ok(()) => {
            counts.queued.fetch_add(1, Ordering::Relaxed);
        }
        Err(TrySendError::Full(msg)) => match when_full {
            WhenFull::Drop => {
                counts.dropped.fetch_add(1, Ordering::Relaxed);
            }
            WhenFull::Block => {
                counts.delayed.fetch_add(1, Ordering::Relaxed);
                // Counted queued before the send: the writer may write it
                // (and count it written) before send returns.
                counts.queued.fetch_add(1, Ordering::Relaxed);
                // Only a writer thread that died closes the queue: the line
                // is lost to the output.
                let wait = || {
                    if trail.queue.send(msg).is_err() {
                        counts.write_errors.fetch_add(1, Ordering::Relaxed);
                    }
                };
                // On a Tokio worker, the worker's other tasks move to
                // another thread meanwhile: only the requests with an event
                // to write wait, health checks and metrics go on.
                match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
                    Ok(tokio::runtime::RuntimeFlavor::MultiThread) => {
                        tokio::task::block_in_place(wait)
                    }
                    _ => wait(),
                }
            }
        },
        Err(TrySendError::Disconnected(_)) => {
            counts.queued.fetch_add(1, Ordering::Relaxed);
            counts.write_errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Waits (at most `timeout`) until every event queued before is written
/// out: at shutdown, after the last request. `Err` says why not; the
/// events not written are [`Counts::unwritten`].
pub fn flush(timeout: Duration) -> Result<(), String> {
    let Some(trail) = TRAIL.get() else {
        return Ok(());
    };
    let (done, wait) = std::sync::mpsc::sync_channel(1);
    let deadline = std::time::Instant::now() + timeout;
    let mut msg = Msg::Flush(done);
    // A full buffer: retry until the deadline rather than block past it.
    loop {
        match trail.queue.try_send(msg) {
            Ok(()) => break,
            Err(TrySendError::Full(back)) if std::time::Instant::now() < deadline => {
                msg = back;
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(TrySendError::Full(_)) => {
                return Err(format!("the output took nothing for {timeout:?}"));
            }
            Err(TrySendError::Disconnected(_)) => return Err("the writer has stopped".into()),
        }
    }
    match wait.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now())) {
        Ok(true) => Ok(()),
        Ok(false) => Err("the output refused lines".into()),
        Err(_) => Err(format!("the output took not everything within {timeout:?}")),
    }
}

/// One event as its JSON line (with the newline).
fn line(event: &Event<'_>, at: std::time::SystemTime) -> Vec<u8> {
    #[derive(Serialize)]
    struct Line<'a> {
        timestamp: String,
        target: &'static str,
        #[serde(flatten)]
        event: &'a Event<'a>,
    }
    let mut out = Vec::with_capacity(320);
    let line = Line {
        timestamp: humantime::format_rfc3339_micros(at).to_string(),
        target: TARGET,
        event,
    };
    // A struct of strings always serialises.
    serde_json::to_writer(&mut out, &line).expect("an audit event serialises");
    out.push(b'\n');
    out
}

/// How long a line may wait in the writer's batch: a batch is written once
/// the queue is empty and this has passed since its first line came in,
/// or once it holds [`BATCH_BYTES`], so under load one `write(2)` carries
/// many lines.
const LINGER: Duration = Duration::from_millis(10);

/// The most bytes one batch holds before it is written.
const BATCH_BYTES: usize = 64 * 1024;

/// The writer's batch: the lines since the last write, and how many.
struct Batch {
    bytes: Vec<u8>,
    lines: u64,
    since: std::time::Instant,
    /// Whether the last write failed (one log line per failing spell).
    failing: bool,
}

impl Batch {
    fn push(&mut self, line: &[u8]) {
        if self.lines == 0 {
            self.since = std::time::Instant::now();
        }
        self.bytes.extend_from_slice(line);
        self.lines += 1;
    }

    /// Writes the batch out: its lines count as written, or all as lost
    /// to a write error (a write that failed part way may have put some of
    /// them out: they are counted lost, never twice). Whether it was (with
    /// nothing to write: whether the last write was).
    fn write(&mut self, out: &mut dyn Write, counts: &Counts) -> bool {
        if self.lines == 0 {
            return !self.failing;
        }
        let result = out.write_all(&self.bytes).and_then(|()| out.flush());
        let lines = std::mem::take(&mut self.lines);
        self.bytes.clear();
        match result {
            Ok(()) => {
                counts.written.fetch_add(lines, Ordering::Relaxed);
                self.failing = false;
                true
            }
            Err(e) => {
                counts.write_errors.fetch_add(lines, Ordering::Relaxed);
                if !self.failing {
                    tracing::error!(error = %e, lines, "the audit trail cannot be written: events are lost");
                }
                self.failing = true;
                false
            }
        }
    }
}

/// How long the writer sleeps when it finds the queue empty, at first:
/// it polls rather than waits on the queue, so a sender never has to wake
/// it (with the writer parked on the queue, every line cost the request a
/// futex wake-up and the writer a context switch). Each empty look doubles
/// the sleep, up to [`IDLE_TICK`]; a line sets it back.
const TICK: Duration = Duration::from_millis(2);

/// The longest sleep of an idle writer: what a line or a flush waits at
/// most after a quiet spell.
const IDLE_TICK: Duration = Duration::from_millis(50);

/// The writer thread: batches what is queued and writes each batch once
/// the queue is empty and [`LINGER`] has passed since its first line (or
/// once it holds [`BATCH_BYTES`]), until every sender is gone.
fn write_all(lines: Receiver<Msg>, mut out: Box<dyn Write + Send>, counts: &Counts) {
    use std::sync::mpsc::TryRecvError;
    let mut batch = Batch {
        bytes: Vec::with_capacity(BATCH_BYTES + 1024),
        lines: 0,
        since: std::time::Instant::now(),
        failing: false,
    };
    let mut tick = TICK;
    loop {
        match lines.try_recv() {
            Ok(Msg::Line(line)) => {
                tick = TICK;
                batch.push(&line);
                if batch.bytes.len() >= BATCH_BYTES {
                    batch.write(&mut *out, counts);
                }
            }
            Ok(Msg::Flush(done)) => {
                let written = batch.write(&mut *out, counts);
                let _ = done.try_send(written);
            }
            Err(TryRecvError::Empty) => {
                if batch.lines > 0 && batch.since.elapsed() >= LINGER {
                    batch.write(&mut *out, counts);
                }
                std::thread::sleep(tick);
                tick = (tick * 2).min(IDLE_TICK);
            }
            Err(TryRecvError::Disconnected) => break,
        }
    }
    batch.write(&mut *out, counts);
}

#[cfg(test)]
mod tests {
    use super::{Event, Output, line};

    #[test]
    fn an_event_is_one_json_line() {
        let event = Event {
            rpc: "Authorize",
            key_id: "agent-1",
            tenant: "acme",
            permit_id: "p",
            tool: "t",
            idempotency_key: "k\"\n",
            outcome: "DISPATCH",
            attempt_id: "a",
        };
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_micros(1_700_000_000_123_456);
        let text = String::from_utf8(line(&event, at)).expect("utf-8");
        assert_eq!(text.matches('\n').count(), 1, "{text}");
        assert!(text.ends_with('\n'));
        let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        assert_eq!(v["timestamp"], "2023-11-14T22:13:20.123456Z");
        assert_eq!(v["target"], "atmost::audit");
        assert_eq!(v["idempotency_key"], "k\"\n");
        assert_eq!(v["outcome"], "DISPATCH");
        assert_eq!(v.as_object().expect("object").len(), 10);
    }

    #[test]
    fn outputs_parse() {
        assert_eq!("stderr".parse(), Ok(Output::Stderr));
        assert_eq!("stdout".parse(), Ok(Output::Stdout));
        assert_eq!("off".parse(), Ok(Output::Off));
        assert_eq!(
            "/var/log/atmost/audit.jsonl".parse(),
            Ok(Output::File("/var/log/atmost/audit.jsonl".into()))
        );
        assert!("".parse::<Output>().is_err());
    }
}
