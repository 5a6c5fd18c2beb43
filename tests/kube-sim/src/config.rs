//! What a simulated cluster starts with: users (bearer tokens), the RBAC rules that bind
//! them, pods to pre-create and a few timing knobs that keep tests fast.

use std::net::SocketAddr;
use std::time::Duration;

/// Token of the admin user that [`SimConfig::default_with_admin`] creates.
pub const ADMIN_TOKEN: &str = "kube-sim-admin-token";
/// Name of that admin user.
pub const ADMIN_USER: &str = "admin";

/// A user known by bearer token.
#[derive(Debug, Clone)]
pub struct UserEntry {
    pub token: String,
    pub name: String,
    pub groups: Vec<String>,
}

/// Who a rule applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Subject {
    User(String),
    Group(String),
}

impl From<&str> for Subject {
    /// `group:NAME` names a group; `user:NAME` or a bare name names a user.
    fn from(s: &str) -> Self {
        if let Some(g) = s.strip_prefix("group:") {
            Subject::Group(g.to_string())
        } else {
            Subject::User(s.strip_prefix("user:").unwrap_or(s).to_string())
        }
    }
}

/// One allow rule: verbs × resources × namespaces. `*` matches anything; an empty
/// namespace list or `*` also covers cluster-scoped requests.
#[derive(Debug, Clone)]
pub struct Rule {
    pub subject: Subject,
    pub verbs: Vec<String>,
    pub resources: Vec<String>,
    pub namespaces: Vec<String>,
}

/// A pod created when the server starts.
#[derive(Debug, Clone)]
pub struct PodSeed {
    pub namespace: String,
    pub name: String,
    pub containers: Vec<String>,
    pub labels: Vec<(String, String)>,
}

/// Configuration of a [`crate::KubeSim`].
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub(crate) users: Vec<UserEntry>,
    pub(crate) rules: Vec<Rule>,
    pub(crate) pods: Vec<PodSeed>,
    pub(crate) listen: SocketAddr,
    pub(crate) cluster_name: String,
    pub(crate) bookmark_interval: Duration,
    pub(crate) pod_termination_delay: Duration,
    pub(crate) event_window: usize,
    pub(crate) demo_objects: bool,
    pub(crate) exec_v4_only: bool,
    pub(crate) max_store_bytes: usize,
}

impl Default for SimConfig {
    /// No users at all: every request is 401 until [`SimConfig::user`] adds one.
    fn default() -> Self {
        Self {
            users: Vec::new(),
            rules: Vec::new(),
            pods: Vec::new(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            cluster_name: "kube-sim".to_string(),
            bookmark_interval: Duration::from_secs(1),
            pod_termination_delay: Duration::from_millis(500),
            event_window: 1000,
            demo_objects: false,
            exec_v4_only: false,
            max_store_bytes: crate::store::MAX_BYTES,
        }
    }
}

impl SimConfig {
    /// One admin user ([`ADMIN_TOKEN`]) in group `system:masters`, allowed everything.
    pub fn default_with_admin() -> Self {
        Self::default()
            .user(ADMIN_TOKEN, ADMIN_USER, &["system:masters"])
            .allow("group:system:masters", &["*"], &["*"], &["*"])
    }

    /// Adds a user authenticated by `token`. `system:authenticated` is added to its groups.
    pub fn user(mut self, token: &str, name: &str, groups: &[&str]) -> Self {
        let mut groups: Vec<String> = groups.iter().map(|g| g.to_string()).collect();
        if !groups.iter().any(|g| g == "system:authenticated") {
            groups.push("system:authenticated".to_string());
        }
        self.users.push(UserEntry {
            token: token.to_string(),
            name: name.to_string(),
            groups,
        });
        self
    }

    /// Allows `subject` (`user:NAME`, `group:NAME` or a bare user name) the verbs on the
    /// resources (`pods`, `pods/exec`, `users` for impersonation, `*`) in the namespaces
    /// (`*` or empty: all namespaces and cluster-scoped resources).
    pub fn allow(
        mut self,
        subject: &str,
        verbs: &[&str],
        resources: &[&str],
        namespaces: &[&str],
    ) -> Self {
        self.rules.push(Rule {
            subject: Subject::from(subject),
            verbs: verbs.iter().map(|s| s.to_string()).collect(),
            resources: resources.iter().map(|s| s.to_string()).collect(),
            namespaces: namespaces.iter().map(|s| s.to_string()).collect(),
        });
        self
    }

    /// Pre-creates a running pod with the given containers.
    pub fn pod(mut self, namespace: &str, name: &str, containers: &[&str]) -> Self {
        self.pods.push(PodSeed {
            namespace: namespace.to_string(),
            name: name.to_string(),
            containers: containers.iter().map(|s| s.to_string()).collect(),
            labels: Vec::new(),
        });
        self
    }

    /// Address to listen on; only loopback addresses are accepted by `start`.
    pub fn listen(mut self, addr: SocketAddr) -> Self {
        self.listen = addr;
        self
    }

    /// Name used for the cluster and context in generated kubeconfigs.
    pub fn cluster_name(mut self, name: &str) -> Self {
        self.cluster_name = name.to_string();
        self
    }

    /// How often watches with `allowWatchBookmarks=true` get a BOOKMARK.
    pub fn bookmark_interval(mut self, every: Duration) -> Self {
        self.bookmark_interval = every;
        self
    }

    /// How long a pod deleted with a grace period stays terminating (capped by the grace).
    pub fn pod_termination_delay(mut self, delay: Duration) -> Self {
        self.pod_termination_delay = delay;
        self
    }

    /// How many past events are kept for watches; older resourceVersions get 410.
    pub fn event_window(mut self, events: usize) -> Self {
        self.event_window = events.max(1);
        self
    }

    /// Answer exec/attach with `v4.channel.k8s.io` even when v5 is offered, like a
    /// kubelet older than 1.30.
    pub fn exec_v4_only(mut self, on: bool) -> Self {
        self.exec_v4_only = on;
        self
    }

    /// Caps the total size (as JSON) of stored objects; writes beyond it fail like a full
    /// etcd. The default is 512 MiB.
    pub fn max_store_bytes(mut self, bytes: usize) -> Self {
        self.max_store_bytes = bytes;
        self
    }

    /// Also create a small demo workload (pods and a deployment) at start.
    pub fn demo_objects(mut self, on: bool) -> Self {
        self.demo_objects = on;
        self
    }
}
