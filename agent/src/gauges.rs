//! Live counts of what the agent holds: tunnel streams being served and
//! exec / port-forward sessions. A stream or session that outlives its
//! caller or its tunnel is a leak nobody would otherwise see; these counts
//! make it visible (at `/metrics` on the health listener) and testable.

use std::sync::{
    Arc,
    atomic::{AtomicI64, Ordering},
};

use crate::{AgentStatus, sessions::Kind};

/// The counts; shared by the tunnel loop and the runtime service.
#[derive(Debug, Default)]
pub struct Gauges {
    streams: AtomicI64,
    exec: AtomicI64,
    port_forward: AtomicI64,
}

/// Which count a [`Held`] keeps raised.
#[derive(Debug, Clone, Copy)]
enum Which {
    Stream,
    Session(Kind),
}

/// One unit of a count, given back when dropped, so the count follows the
/// lifetime of the task that holds it however that task ends.
#[derive(Debug)]
pub struct Held {
    gauges: Arc<Gauges>,
    which: Which,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.gauges
            .counter(self.which)
            .fetch_sub(1, Ordering::SeqCst);
    }
}

impl Gauges {
    fn counter(&self, which: Which) -> &AtomicI64 {
        match which {
            Which::Stream => &self.streams,
            Which::Session(Kind::Exec) => &self.exec,
            Which::Session(Kind::PortForward) => &self.port_forward,
        }
    }

    fn hold(self: &Arc<Self>, which: Which) -> Held {
        self.counter(which).fetch_add(1, Ordering::SeqCst);
        Held {
            gauges: self.clone(),
            which,
        }
    }

    /// Counts a tunnel stream until the returned value is dropped.
    pub fn stream(self: &Arc<Self>) -> Held {
        self.hold(Which::Stream)
    }

    /// Counts a session of `kind` until the returned value is dropped.
    pub fn session(self: &Arc<Self>, kind: Kind) -> Held {
        self.hold(Which::Session(kind))
    }

    /// Tunnel streams being served right now.
    pub fn streams(&self) -> i64 {
        self.streams.load(Ordering::SeqCst)
    }

    /// Sessions of `kind` alive right now.
    pub fn sessions(&self, kind: Kind) -> i64 {
        self.counter(Which::Session(kind)).load(Ordering::SeqCst)
    }

    /// The Prometheus text exposition of the counts and of `status`.
    pub fn render(&self, status: &AgentStatus) -> String {
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, rows: &[(&str, i64)]| {
            out.push_str(&format!(
                "# HELP otter_agent_{name} {help}\n# TYPE otter_agent_{name} {kind}\n"
            ));
            for (labels, v) in rows {
                out.push_str(&format!("otter_agent_{name}{labels} {v}\n"));
            }
        };
        metric(
            "tunnel_up",
            "gauge",
            "1 while a tunnel to the hub is up",
            &[("", i64::from(status.connected.is_some()))],
        );
        metric(
            "tunnel_streams",
            "gauge",
            "Tunnel streams being served",
            &[("", self.streams())],
        );
        metric(
            "sessions",
            "gauge",
            "Exec and port-forward sessions alive",
            &[
                ("{kind=\"exec\"}", self.sessions(Kind::Exec)),
                ("{kind=\"port-forward\"}", self.sessions(Kind::PortForward)),
            ],
        );
        metric(
            "certificate_not_after_seconds",
            "gauge",
            "When the agent's certificate expires (Unix seconds, the hub's clock); a renewal failing for long shows as this coming near",
            &[("", status.cert_not_after)],
        );
        let counters = [
            ("connects", "Tunnels established", status.connects),
            (
                "renewal_failures",
                "Renewals that failed (each retried after a backoff)",
                status.renewal_failures,
            ),
            (
                "redials",
                "Tunnels moved to a renewed certificate, make before break",
                status.redials,
            ),
            (
                "registrations",
                "Registrations with a join token",
                status.registrations,
            ),
            ("renewals", "Certificate renewals", status.renewals),
            (
                "renewals_on_tunnel_port",
                "Renewals made on the tunnel port (the others on the API port)",
                status.renewals_on_tunnel_port,
            ),
            ("dials", "Tunnel dial rounds", status.dials),
            (
                "switches",
                "Moves to a better transport while connected",
                status.switches,
            ),
            (
                "quality_moves",
                "Moves off a transport that lost too many packets",
                status.quality_moves,
            ),
            (
                "quiet_probes",
                "New tunnels dialled beside one whose path went quiet",
                status.quiet_probes,
            ),
            (
                "refused_probes",
                "New tunnels dialled beside one whose hub's host refused its datagrams",
                status.refused_probes,
            ),
            (
                "refusals",
                "Dials the hub refused with a retry-after hint",
                status.refusals,
            ),
        ];
        for (name, help, v) in counters {
            metric(
                &format!("{name}_total"),
                "counter",
                help,
                &[("", i64::from(v))],
            );
        }
        out
    }
}

/// The value of an unlabelled or labelled sample in a text exposition, e.g.
/// `sample(text, "otter_agent_sessions{kind=\"exec\"}")`.
pub fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_follow_the_holders() {
        let g = Arc::new(Gauges::default());
        let s = g.stream();
        let e = g.session(Kind::Exec);
        let text = g.render(&AgentStatus::default());
        assert_eq!(sample(&text, "otter_agent_tunnel_streams"), Some(1.0));
        assert_eq!(
            sample(&text, "otter_agent_sessions{kind=\"exec\"}"),
            Some(1.0)
        );
        assert_eq!(
            sample(&text, "otter_agent_sessions{kind=\"port-forward\"}"),
            Some(0.0)
        );
        drop((s, e));
        assert_eq!(g.streams(), 0);
        assert_eq!(g.sessions(Kind::Exec), 0);
    }

    #[test]
    fn renewal_health_is_exposed() {
        let g = Arc::new(Gauges::default());
        let status = AgentStatus {
            renewal_failures: 2,
            redials: 1,
            cert_not_after: 1_800_000_000,
            ..Default::default()
        };
        let text = g.render(&status);
        assert_eq!(
            sample(&text, "otter_agent_certificate_not_after_seconds"),
            Some(1.8e9)
        );
        assert_eq!(
            sample(&text, "otter_agent_renewal_failures_total"),
            Some(2.0)
        );
        assert_eq!(sample(&text, "otter_agent_redials_total"), Some(1.0));
    }
}
