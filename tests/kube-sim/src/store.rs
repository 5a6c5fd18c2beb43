//! The object store: JSON objects keyed by group, resource, namespace and name; one global
//! resourceVersion counter; a bounded log of past events for watches that resume; and a
//! broadcast channel that fans new events out to running watches.
//!
//! Objects are stored once per group and resource, whatever version they were written at
//! (custom resources have no conversion: "None" strategy rewrites `apiVersion` only).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::{Value, json};
use tokio::sync::broadcast;

/// Where an object lives.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjKey {
    pub group: String,
    pub plural: String,
    pub namespace: String,
    pub name: String,
}

impl ObjKey {
    pub fn new(group: &str, plural: &str, namespace: &str, name: &str) -> Self {
        Self {
            group: group.into(),
            plural: plural.into(),
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

/// Kind of a watch event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One change, as watches see it.
#[derive(Debug, Clone)]
pub struct StoreEvent {
    pub rv: u64,
    pub etype: EventType,
    pub key: ObjKey,
    pub object: Arc<Value>,
    /// The object before a MODIFIED event: a filtered watch turns a change that enters or
    /// leaves its selector into ADDED or DELETED, as the apiserver does.
    pub prev: Option<Arc<Value>>,
}

/// Why a write was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteError {
    AlreadyExists,
    NotFound,
    /// The object's resourceVersion was not the expected one.
    Conflict,
    /// The store holds [`MAX_BYTES`] already.
    Full,
}

/// Total size of stored objects (as JSON) the store accepts: clients cannot grow it without
/// bound, as etcd's quota stops a real cluster.
pub const MAX_BYTES: usize = 512 * 1024 * 1024;

fn size_of(obj: &Value) -> usize {
    serde_json::to_vec(obj).map(|v| v.len()).unwrap_or(0)
}

/// A watch's starting point: either a list of current objects (as ADDED), or past events.
#[derive(Debug)]
pub struct WatchStart {
    pub initial: Vec<Arc<StoreEvent>>,
    pub rv: u64,
    pub rx: broadcast::Receiver<Arc<StoreEvent>>,
}

#[derive(Debug)]
struct Inner {
    rv: u64,
    objects: BTreeMap<ObjKey, Value>,
    log: VecDeque<Arc<StoreEvent>>,
    /// Events at or below this resourceVersion are gone: resuming from there is 410.
    compacted: u64,
    /// Sum of the JSON sizes of the stored objects.
    bytes: usize,
}

/// The object store. See the module docs.
#[derive(Debug)]
pub struct Store {
    inner: Mutex<Inner>,
    tx: broadcast::Sender<Arc<StoreEvent>>,
    window: usize,
    max_bytes: usize,
}

fn rv_of(obj: &Value) -> Option<u64> {
    obj.pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .and_then(|s| s.parse().ok())
}

fn set_rv(obj: &mut Value, rv: u64) {
    if let Some(m) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        m.insert("resourceVersion".into(), json!(rv.to_string()));
    }
}

impl Store {
    pub fn new(window: usize) -> Self {
        // The broadcast buffer bounds how far a slow watch may lag before it is ended
        // (its client then resumes from its last resourceVersion).
        let (tx, _) = broadcast::channel(4096);
        Self {
            inner: Mutex::new(Inner {
                rv: 1,
                objects: BTreeMap::new(),
                log: VecDeque::new(),
                compacted: 0,
                bytes: 0,
            }),
            tx,
            window: window.max(1),
            max_bytes: MAX_BYTES,
        }
    }

    /// Lowers the size cap (tests of the cap itself).
    pub fn with_max_bytes(mut self, max: usize) -> Self {
        self.max_bytes = max;
        self
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves consistent data (every write is one insert),
        // so a poisoned lock is still usable.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn current_rv(&self) -> u64 {
        self.lock().rv
    }

    pub fn compacted_rv(&self) -> u64 {
        self.lock().compacted
    }

    pub fn get(&self, key: &ObjKey) -> Option<Value> {
        self.lock().objects.get(key).cloned()
    }

    /// Objects of a resource, optionally in one namespace, sorted by namespace and name.
    pub fn list(&self, group: &str, plural: &str, namespace: Option<&str>) -> (Vec<Value>, u64) {
        let inner = self.lock();
        let items = inner
            .objects
            .iter()
            .filter(|(k, _)| {
                k.group == group
                    && k.plural == plural
                    && namespace.is_none_or(|ns| k.namespace == ns)
            })
            .map(|(_, v)| v.clone())
            .collect();
        (items, inner.rv)
    }

    /// Keys of every object in a namespace (for namespace deletion).
    pub fn keys_in_namespace(&self, namespace: &str) -> Vec<ObjKey> {
        self.lock()
            .objects
            .keys()
            .filter(|k| k.namespace == namespace)
            .cloned()
            .collect()
    }

    fn record(
        &self,
        inner: &mut Inner,
        etype: EventType,
        key: &ObjKey,
        obj: &Value,
        prev: Option<Value>,
    ) {
        let ev = Arc::new(StoreEvent {
            rv: inner.rv,
            etype,
            key: key.clone(),
            object: Arc::new(obj.clone()),
            prev: prev.map(Arc::new),
        });
        inner.log.push_back(ev.clone());
        while inner.log.len() > self.window {
            if let Some(old) = inner.log.pop_front() {
                inner.compacted = old.rv;
            }
        }
        // No receivers is fine: nobody is watching.
        let _ = self.tx.send(ev);
    }

    pub fn create(&self, key: &ObjKey, mut obj: Value) -> Result<Value, WriteError> {
        let mut inner = self.lock();
        if inner.objects.contains_key(key) {
            return Err(WriteError::AlreadyExists);
        }
        let size = size_of(&obj);
        if inner.bytes + size > self.max_bytes {
            return Err(WriteError::Full);
        }
        inner.bytes += size;
        inner.rv += 1;
        let rv = inner.rv;
        set_rv(&mut obj, rv);
        inner.objects.insert(key.clone(), obj.clone());
        self.record(&mut inner, EventType::Added, key, &obj, None);
        Ok(obj)
    }

    /// Replaces an object if its stored resourceVersion is still `expect_rv` (when given).
    pub fn update(
        &self,
        key: &ObjKey,
        mut obj: Value,
        expect_rv: Option<u64>,
    ) -> Result<Value, WriteError> {
        let mut inner = self.lock();
        let cur = inner.objects.get(key).ok_or(WriteError::NotFound)?;
        if let Some(want) = expect_rv
            && rv_of(cur) != Some(want)
        {
            return Err(WriteError::Conflict);
        }
        let mut same = obj.clone();
        set_rv(&mut same, rv_of(cur).unwrap_or(0));
        if *cur == same {
            // A no-op write keeps the resourceVersion and emits nothing, like the apiserver.
            return Ok(cur.clone());
        }
        let prev = cur.clone();
        let (old_size, new_size) = (size_of(&prev), size_of(&obj));
        if inner.bytes - old_size.min(inner.bytes) + new_size > self.max_bytes {
            return Err(WriteError::Full);
        }
        inner.bytes = inner.bytes - old_size.min(inner.bytes) + new_size;
        inner.rv += 1;
        let rv = inner.rv;
        set_rv(&mut obj, rv);
        inner.objects.insert(key.clone(), obj.clone());
        self.record(&mut inner, EventType::Modified, key, &obj, Some(prev));
        Ok(obj)
    }

    /// Removes an object (if its resourceVersion still matches, when given) and returns it.
    pub fn delete(&self, key: &ObjKey, expect_rv: Option<u64>) -> Result<Value, WriteError> {
        let mut inner = self.lock();
        let cur = inner.objects.get(key).ok_or(WriteError::NotFound)?;
        if let Some(want) = expect_rv
            && rv_of(cur) != Some(want)
        {
            return Err(WriteError::Conflict);
        }
        let mut obj = inner.objects.remove(key).ok_or(WriteError::NotFound)?;
        inner.bytes -= size_of(&obj).min(inner.bytes);
        inner.rv += 1;
        let rv = inner.rv;
        set_rv(&mut obj, rv);
        self.record(&mut inner, EventType::Deleted, key, &obj, None);
        Ok(obj)
    }

    /// Starts a watch of one resource. `from` None: every current object as ADDED, then live
    /// events. `from` Some(rv): past events after rv, then live ones; `Err(compacted)` when rv
    /// is older than the kept history.
    pub fn watch(&self, group: &str, plural: &str, from: Option<u64>) -> Result<WatchStart, u64> {
        let inner = self.lock();
        let rx = self.tx.subscribe();
        let initial = match from {
            None => inner
                .objects
                .iter()
                .filter(|(k, _)| k.group == group && k.plural == plural)
                .map(|(k, v)| {
                    Arc::new(StoreEvent {
                        rv: rv_of(v).unwrap_or(inner.rv),
                        etype: EventType::Added,
                        key: k.clone(),
                        object: Arc::new(v.clone()),
                        prev: None,
                    })
                })
                .collect(),
            Some(rv) => {
                if rv < inner.compacted {
                    return Err(inner.compacted);
                }
                inner
                    .log
                    .iter()
                    .filter(|e| e.rv > rv && e.key.group == group && e.key.plural == plural)
                    .cloned()
                    .collect()
            }
        };
        Ok(WatchStart {
            initial,
            rv: inner.rv,
            rx,
        })
    }

    /// Forgets every past event, so resuming a watch from any earlier version gets 410.
    pub fn compact(&self) {
        let mut inner = self.lock();
        // A fresh version marks the compaction point, so every version handed out before
        // (list tokens, watch starting points) is now too old.
        inner.rv += 1;
        inner.log.clear();
        inner.compacted = inner.rv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(name: &str) -> Value {
        json!({"metadata": {"name": name, "namespace": "ns"}})
    }

    #[test]
    fn versions_and_conflicts() {
        let s = Store::new(10);
        let k = ObjKey::new("", "configmaps", "ns", "a");
        let a = s.create(&k, obj("a")).unwrap();
        assert_eq!(s.create(&k, obj("a")), Err(WriteError::AlreadyExists));
        let rv = rv_of(&a).unwrap();
        let mut b = a.clone();
        b["data"] = json!({"x": "1"});
        let b2 = s.update(&k, b.clone(), Some(rv)).unwrap();
        assert!(rv_of(&b2).unwrap() > rv);
        assert_eq!(s.update(&k, b, Some(rv)), Err(WriteError::Conflict));
    }

    #[test]
    fn size_cap() {
        let s = Store::new(10).with_max_bytes(200);
        let big = json!({"metadata": {"name": "a"}, "data": {"x": "y".repeat(150)}});
        s.create(&ObjKey::new("", "configmaps", "ns", "a"), big.clone())
            .unwrap();
        assert_eq!(
            s.create(&ObjKey::new("", "configmaps", "ns", "b"), big.clone()),
            Err(WriteError::Full)
        );
        s.delete(&ObjKey::new("", "configmaps", "ns", "a"), None)
            .unwrap();
        s.create(&ObjKey::new("", "configmaps", "ns", "b"), big)
            .unwrap();
    }

    #[test]
    fn watch_resume_and_compaction() {
        let s = Store::new(3);
        let start = s.current_rv();
        for i in 0..2 {
            s.create(
                &ObjKey::new("", "configmaps", "ns", &format!("c{i}")),
                obj("c"),
            )
            .unwrap();
        }
        let w = s.watch("", "configmaps", Some(start)).unwrap();
        assert_eq!(w.initial.len(), 2);
        for i in 2..6 {
            s.create(
                &ObjKey::new("", "configmaps", "ns", &format!("c{i}")),
                obj("c"),
            )
            .unwrap();
        }
        assert!(s.watch("", "configmaps", Some(start)).is_err());
        s.compact();
        assert!(s.watch("", "configmaps", Some(s.current_rv() - 1)).is_err());
        assert!(s.watch("", "configmaps", Some(s.current_rv())).is_ok());
        assert_eq!(s.watch("", "configmaps", None).unwrap().initial.len(), 6);
    }
}
