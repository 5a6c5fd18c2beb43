//! The audit log: one JSON line per registration, tunnel admitted or
//! refused, forwarded call, kubectl request and admin action — who (tenant,
//! user, groups), what (cluster, method or verb and path), how it ended
//! (code), how long it took and from where.
//!
//! Lines go to a file (`--audit-log PATH`, rotated by size, a few old files
//! kept) or to stdout (`--audit-log -`). A writer task does the I/O, so a
//! call never waits on the disk; when it falls far behind, lines are
//! dropped and counted (`otter_audit_dropped_total`) rather than the calls
//! held up.

use std::{
    io::Write,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use serde::Serialize;
use tokio::sync::mpsc;

use crate::{Result, metrics::Metrics};

/// Lines waiting for the writer, at most.
const QUEUE: usize = 16 * 1024;
/// Rotated files kept beside the current one (`PATH.1` … `PATH.3`).
const KEEP: usize = 3;
/// Readers of the audit log at once; more are told to come back.
const READERS: usize = 2;
/// Lines a reader gets back at most.
pub const MAX_READ_LINES: usize = 10_000;

/// Where audit lines go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Stdout,
    File { path: PathBuf, max_bytes: u64 },
}

/// One audited event.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Event {
    /// RFC 3339, milliseconds, UTC.
    pub time: String,
    /// `call`, `kube`, `session`, `register`, `tunnel`, `admin`.
    pub kind: &'static str,
    /// Of a session (exec, attach, port-forward: a gRPC session call or an
    /// upgraded kubectl connection): `open` when it starts, `close` with
    /// its whole duration when it ends.
    #[serde(skip_serializing_if = "str::is_empty")]
    pub phase: &'static str,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub tenant: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub user: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<String>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub cluster: String,
    /// The gRPC method, or the HTTP verb and path.
    pub action: String,
    /// A gRPC code name (`OK`, `NotFound`, …) or an HTTP status.
    pub code: String,
    pub duration_ms: f64,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub remote: String,
    /// Why a session or stream ended, when the code does not say it
    /// (`caller`, `cluster`, `idle`, `revoked`, `expired`).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub reason: String,
}

/// The audit log's front: cheap to clone, never blocks.
#[derive(Debug, Clone)]
pub struct Audit {
    tx: Option<mpsc::Sender<Event>>,
    metrics: Arc<Metrics>,
    target: Option<Target>,
    /// Readers at once: each streams up to every file.
    readers: Arc<tokio::sync::Semaphore>,
}

impl Audit {
    /// No audit log.
    pub fn off(metrics: Arc<Metrics>) -> Self {
        Audit {
            tx: None,
            metrics,
            target: None,
            readers: Arc::new(tokio::sync::Semaphore::new(READERS)),
        }
    }

    /// Starts the writer, a thread of its own (file I/O blocks); it ends,
    /// having written everything queued, when every `Audit` is gone.
    pub fn start(target: Target, metrics: Arc<Metrics>) -> Result<Self> {
        let mut out = Output::open(&target)?;
        let (tx, mut rx) = mpsc::channel::<Event>(QUEUE);
        std::thread::Builder::new()
            .name("otter-audit".into())
            .spawn(move || {
                while let Some(first) = rx.blocking_recv() {
                    out.write(&first);
                    // What else is queued goes out with it, then one flush.
                    while let Ok(next) = rx.try_recv() {
                        out.write(&next);
                    }
                    out.flush();
                }
            })?;
        Ok(Audit {
            tx: Some(tx),
            metrics,
            target: Some(target),
            readers: Arc::new(tokio::sync::Semaphore::new(READERS)),
        })
    }

    /// Whether lines are written at all: callers skip building them if not.
    pub fn enabled(&self) -> bool {
        self.tx.is_some()
    }

    /// A place to read the log, if one is free now.
    pub fn reader(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.readers.clone().try_acquire_owned().ok()
    }

    /// Where lines go, if anywhere.
    pub fn target(&self) -> Option<&Target> {
        self.target.as_ref()
    }

    /// Records `event` (its time is set here).
    pub fn record(&self, mut event: Event) {
        let Some(tx) = &self.tx else {
            return;
        };
        event.time = now_rfc3339();
        if tx.try_send(event).is_err() {
            self.metrics.audit_dropped.inc();
        }
    }
}

/// Times an event from its start.
#[derive(Debug, Clone)]
pub struct Timer(Instant);

impl Timer {
    pub fn start() -> Self {
        Timer(Instant::now())
    }

    pub fn millis(&self) -> f64 {
        (self.0.elapsed().as_micros() as f64) / 1000.0
    }
}

fn now_rfc3339() -> String {
    time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// The writer's side: stdout or a file it rotates.
enum Output {
    Stdout(std::io::BufWriter<std::io::Stdout>),
    File {
        path: PathBuf,
        max_bytes: u64,
        file: std::io::BufWriter<std::fs::File>,
        written: u64,
    },
}

impl Output {
    fn open(target: &Target) -> Result<Self> {
        Ok(match target {
            Target::Stdout => Output::Stdout(std::io::BufWriter::new(std::io::stdout())),
            Target::File { path, max_bytes } => {
                let file = open_append(path)?;
                let written = file.metadata()?.len();
                Output::File {
                    path: path.clone(),
                    max_bytes: *max_bytes,
                    file: std::io::BufWriter::new(file),
                    written,
                }
            }
        })
    }

    fn write(&mut self, event: &Event) {
        let Ok(mut line) = serde_json::to_vec(event) else {
            return;
        };
        line.push(b'\n');
        let result = match self {
            Output::Stdout(out) => out.write_all(&line),
            Output::File {
                path,
                max_bytes,
                file,
                written,
            } => {
                if *written + line.len() as u64 > *max_bytes && *written > 0 {
                    match rotate(path).and_then(|()| open_append(path)) {
                        Ok(fresh) => {
                            let _ = file.flush();
                            *file = std::io::BufWriter::new(fresh);
                            *written = 0;
                        }
                        Err(e) => tracing::error!(error = %e, "audit log rotation failed"),
                    }
                }
                *written += line.len() as u64;
                file.write_all(&line)
            }
        };
        if let Err(e) = result {
            tracing::error!(error = %e, "audit log write failed");
        }
    }

    fn flush(&mut self) {
        let _ = match self {
            Output::Stdout(out) => out.flush(),
            Output::File { file, .. } => file.flush(),
        };
    }
}

/// An audit file readable by its owner only: it names users and clusters.
fn open_append(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)
}

/// `PATH.2` → `PATH.3`, `PATH.1` → `PATH.2`, `PATH` → `PATH.1`.
fn rotate(path: &Path) -> std::io::Result<()> {
    let numbered = |n: usize| PathBuf::from(format!("{}.{n}", path.display()));
    for n in (1..KEEP).rev() {
        if numbered(n).exists() {
            std::fs::rename(numbered(n), numbered(n + 1))?;
        }
    }
    std::fs::rename(path, numbered(1))
}

/// The longest look back a reader may ask for.
pub const MAX_SINCE: Duration = Duration::from_secs(400 * 24 * 3600);

/// The audit lines of files at `path` (oldest first), those of `tenant`
/// when given, from `since` ago on and not before the Unix second
/// `not_before`, the last [`MAX_READ_LINES`] at most. Files are streamed
/// line by line: memory stays bounded by the lines kept, however large the
/// files.
pub fn read(
    path: &Path,
    tenant: Option<&str>,
    since: Duration,
    not_before: Option<i64>,
) -> Result<Vec<serde_json::Value>> {
    use std::io::BufRead;
    let since = time::Duration::try_from(since.min(MAX_SINCE)).unwrap_or(time::Duration::ZERO);
    let mut cutoff = time::OffsetDateTime::now_utc()
        .checked_sub(since)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    if let Some(t) = not_before.and_then(|s| time::OffsetDateTime::from_unix_timestamp(s).ok()) {
        cutoff = cutoff.max(t);
    }
    let mut files: Vec<PathBuf> = (1..=KEEP)
        .rev()
        .map(|n| PathBuf::from(format!("{}.{n}", path.display())))
        .filter(|p| p.exists())
        .collect();
    files.push(path.to_owned());
    let mut out = std::collections::VecDeque::new();
    for file in files {
        let Ok(f) = std::fs::File::open(&file) else {
            continue;
        };
        let mut lines = std::io::BufReader::new(f);
        let mut line = Vec::new();
        loop {
            line.clear();
            // One line at most 64 KiB (the hub writes far shorter ones).
            match std::io::Read::take(&mut lines, 64 * 1024).read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&line) else {
                continue;
            };
            if tenant.is_some_and(|t| v["tenant"].as_str() != Some(t)) {
                continue;
            }
            let recent = v["time"]
                .as_str()
                .and_then(|t| {
                    time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339)
                        .ok()
                })
                .is_some_and(|t| t >= cutoff);
            if !recent {
                continue;
            }
            if out.len() == MAX_READ_LINES {
                out.pop_front();
            }
            out.push_back(v);
        }
    }
    Ok(out.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_rotate_by_size_and_read_back_filtered() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let target = Target::File {
            path: path.clone(),
            max_bytes: 400,
        };
        let mut out = Output::open(&target).unwrap();
        for i in 0..20 {
            let event = Event {
                time: now_rfc3339(),
                kind: "call",
                tenant: if i % 2 == 0 { "acme" } else { "globex" }.into(),
                user: format!("u{i}"),
                action: "/x.Y/Z".into(),
                code: "OK".into(),
                ..Default::default()
            };
            out.write(&event);
        }
        out.flush();
        for n in 1..=KEEP {
            assert!(dir.path().join(format!("audit.log.{n}")).exists(), "{n}");
        }
        assert!(!dir.path().join("audit.log.4").exists());
        assert!(std::fs::metadata(&path).unwrap().len() <= 400);
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&path).unwrap().permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);
        let acme = read(&path, Some("acme"), Duration::from_secs(60), None).unwrap();
        assert!(!acme.is_empty());
        assert!(acme.iter().all(|v| v["tenant"] == "acme"));
        // Oldest first, the newest last.
        assert_eq!(acme.last().unwrap()["user"], "u18");
        assert!(read(&path, None, Duration::ZERO, None).unwrap().is_empty());
        // A namesake made after these lines reads none of them.
        let later = crate::unix_now() + 2;
        assert!(
            read(&path, Some("acme"), MAX_SINCE, Some(later))
                .unwrap()
                .is_empty()
        );
        // However far back one asks: capped, no overflow.
        assert_eq!(
            read(&path, None, Duration::MAX, None).unwrap().len(),
            read(&path, None, MAX_SINCE, None).unwrap().len()
        );
    }
}
