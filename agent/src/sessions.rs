//! Exec and port-forward sessions, sans IO: who owns each one, how many
//! there are, when each was last used. Time is an input, so the rules are
//! tested without clocks or sockets; the runtime service keeps the live
//! connection in the handle `H`.
//!
//! Session ids are `<cluster>:<128 random bits, hex>`: the hub routes the
//! follow-up calls by the part before the first ':', and nobody can guess
//! another session's id.

use std::{collections::HashMap, time::Duration};

use tokio::time::Instant;

/// The two kinds of session, each with its own limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Exec,
    PortForward,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Exec => "exec",
            Kind::PortForward => "port-forward",
        }
    }
}

/// Bounds of the session table.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_exec: usize,
    pub max_port_forward: usize,
    /// A session with no input and no output for this long is ended.
    pub idle: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_exec: 100,
            max_port_forward: 100,
            idle: Duration::from_secs(30 * 60),
        }
    }
}

/// Why a session could not be opened or used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    /// The agent already holds the most sessions of this kind.
    #[error("this agent already has {max} {kind} sessions, the most it keeps; close one and retry")]
    Full { kind: &'static str, max: usize },
    /// No such session (never existed, ended, or reaped).
    #[error("session not found (it ended, was reaped after idling, or never existed)")]
    NotFound,
    /// The session belongs to someone else.
    #[error("session belongs to another user")]
    NotOwner,
    /// The session is of the other kind.
    #[error("session {0} is not a {1} session")]
    WrongKind(String, &'static str),
}

impl From<SessionError> for tonic::Status {
    fn from(e: SessionError) -> Self {
        let msg = e.to_string();
        match e {
            SessionError::Full { .. } => tonic::Status::resource_exhausted(msg),
            SessionError::NotFound => tonic::Status::not_found(msg),
            SessionError::NotOwner => tonic::Status::permission_denied(msg),
            SessionError::WrongKind(..) => tonic::Status::invalid_argument(msg),
        }
    }
}

#[derive(Debug)]
struct Entry<H> {
    kind: Kind,
    owner: String,
    last_used: Instant,
    handle: H,
}

/// The sessions of one agent.
#[derive(Debug)]
pub struct SessionTable<H> {
    cluster: String,
    limits: Limits,
    entries: HashMap<String, Entry<H>>,
}

impl<H: Clone> SessionTable<H> {
    pub fn new(cluster: &str, limits: Limits) -> Self {
        Self {
            cluster: cluster.to_owned(),
            limits,
            entries: HashMap::new(),
        }
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    fn count(&self, kind: Kind) -> usize {
        self.entries.values().filter(|e| e.kind == kind).count()
    }

    /// Opens a session for `owner` with a fresh id made from `random`.
    pub fn open(
        &mut self,
        kind: Kind,
        owner: &str,
        random: [u8; 16],
        now: Instant,
        handle: H,
    ) -> Result<String, SessionError> {
        let max = match kind {
            Kind::Exec => self.limits.max_exec,
            Kind::PortForward => self.limits.max_port_forward,
        };
        if self.count(kind) >= max {
            return Err(SessionError::Full {
                kind: kind.as_str(),
                max,
            });
        }
        let hex: String = random.iter().map(|b| format!("{b:02x}")).collect();
        let id = format!("{}:{hex}", self.cluster);
        self.entries.insert(
            id.clone(),
            Entry {
                kind,
                owner: owner.to_owned(),
                last_used: now,
                handle,
            },
        );
        Ok(id)
    }

    /// The handle of `id` for `user`, marking the session used.
    pub fn use_session(
        &mut self,
        id: &str,
        kind: Kind,
        user: &str,
        now: Instant,
    ) -> Result<H, SessionError> {
        let e = self.entries.get_mut(id).ok_or(SessionError::NotFound)?;
        if e.owner != user {
            return Err(SessionError::NotOwner);
        }
        if e.kind != kind {
            return Err(SessionError::WrongKind(id.to_owned(), kind.as_str()));
        }
        e.last_used = now;
        Ok(e.handle.clone())
    }

    /// Marks `id` used (output flowed).
    pub fn touch(&mut self, id: &str, now: Instant) {
        if let Some(e) = self.entries.get_mut(id) {
            e.last_used = now;
        }
    }

    /// Forgets `id`; its handle is returned.
    pub fn remove(&mut self, id: &str) -> Option<H> {
        self.entries.remove(id).map(|e| e.handle)
    }

    /// Removes and returns the sessions idle for longer than the limit.
    pub fn reap(&mut self, now: Instant) -> Vec<(String, H)> {
        let idle = self.limits.idle;
        let stale: Vec<String> = self
            .entries
            .iter()
            .filter(|(_, e)| now.saturating_duration_since(e.last_used) >= idle)
            .map(|(k, _)| k.clone())
            .collect();
        stale
            .into_iter()
            .filter_map(|k| self.entries.remove(&k).map(|e| (k, e.handle)))
            .collect()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> SessionTable<u32> {
        SessionTable::new(
            "edge-1",
            Limits {
                max_exec: 2,
                max_port_forward: 1,
                idle: Duration::from_secs(10),
            },
        )
    }

    #[test]
    fn ids_name_the_cluster_and_are_random() {
        let mut t = table();
        let now = Instant::now();
        let a = t.open(Kind::Exec, "jane", [1; 16], now, 1).unwrap();
        let b = t.open(Kind::Exec, "jane", [2; 16], now, 2).unwrap();
        assert_eq!(a, format!("edge-1:{}", "01".repeat(16)));
        assert_ne!(a, b);
    }

    #[test]
    fn limits_per_kind() {
        let mut t = table();
        let now = Instant::now();
        t.open(Kind::Exec, "a", [1; 16], now, 1).unwrap();
        t.open(Kind::Exec, "a", [2; 16], now, 2).unwrap();
        let full = t.open(Kind::Exec, "a", [3; 16], now, 3).unwrap_err();
        assert_eq!(
            full,
            SessionError::Full {
                kind: "exec",
                max: 2
            }
        );
        assert_eq!(
            tonic::Status::from(full).code(),
            tonic::Code::ResourceExhausted
        );
        let pf = t.open(Kind::PortForward, "a", [4; 16], now, 4).unwrap();
        assert!(t.open(Kind::PortForward, "a", [5; 16], now, 5).is_err());
        t.remove(&pf);
        t.open(Kind::PortForward, "a", [5; 16], now, 5).unwrap();
    }

    #[test]
    fn only_the_owner_uses_a_session() {
        let mut t = table();
        let now = Instant::now();
        let id = t.open(Kind::Exec, "jane", [1; 16], now, 7).unwrap();
        assert_eq!(t.use_session(&id, Kind::Exec, "jane", now), Ok(7));
        assert_eq!(
            t.use_session(&id, Kind::Exec, "bob", now),
            Err(SessionError::NotOwner)
        );
        assert!(matches!(
            t.use_session(&id, Kind::PortForward, "jane", now),
            Err(SessionError::WrongKind(..))
        ));
        assert_eq!(
            t.use_session("edge-1:nope", Kind::Exec, "jane", now),
            Err(SessionError::NotFound)
        );
    }

    #[test]
    fn idle_sessions_are_reaped_and_use_keeps_them() {
        let mut t = table();
        let t0 = Instant::now();
        let a = t.open(Kind::Exec, "a", [1; 16], t0, 1).unwrap();
        let b = t.open(Kind::Exec, "a", [2; 16], t0, 2).unwrap();
        t.use_session(&a, Kind::Exec, "a", t0 + Duration::from_secs(6))
            .unwrap();
        t.touch(&b, t0 + Duration::from_secs(2));
        assert!(t.reap(t0 + Duration::from_secs(9)).is_empty());
        let reaped = t.reap(t0 + Duration::from_secs(13));
        assert_eq!(reaped, vec![(b, 2)]);
        assert_eq!(t.len(), 1);
        assert_eq!(t.reap(t0 + Duration::from_secs(16)), vec![(a, 1)]);
        assert!(t.is_empty());
    }
}
