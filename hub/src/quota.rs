//! Places counted per key (a tenant, a user, a cluster): a holder takes a
//! place while something of the key's is open and gives it back when it
//! drops, so a bound holds however the holder ends (an answer read to its
//! end, a caller gone, a task cancelled).

use std::{
    collections::HashMap,
    hash::Hash,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
};

/// How many places each key holds now; keys holding none are not kept.
#[derive(Debug)]
pub struct Quota<K> {
    open: Mutex<HashMap<K, usize>>,
}

impl<K> Default for Quota<K> {
    fn default() -> Self {
        Self {
            open: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: Eq + Hash + Clone> Quota<K> {
    fn counts(&self) -> MutexGuard<'_, HashMap<K, usize>> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A place for `key` while it holds fewer than `cap`; `None` when full.
    pub fn take(self: &Arc<Self>, key: &K, cap: usize) -> Option<Place<K>> {
        let mut open = self.counts();
        let n = open.get(key).copied().unwrap_or(0);
        if n >= cap {
            return None;
        }
        open.insert(key.clone(), n + 1);
        Some(Place {
            quota: self.clone(),
            key: key.clone(),
        })
    }

    /// Places `key` holds now.
    pub fn held(&self, key: &K) -> usize {
        self.counts().get(key).copied().unwrap_or(0)
    }

    /// Whether no key holds a place.
    pub fn is_empty(&self) -> bool {
        self.counts().is_empty()
    }
}

/// One place of a [`Quota`], given back on drop.
#[derive(Debug)]
pub struct Place<K: Eq + Hash + Clone> {
    quota: Arc<Quota<K>>,
    key: K,
}

impl<K: Eq + Hash + Clone> Drop for Place<K> {
    fn drop(&mut self) {
        let mut open = self.quota.counts();
        if let Some(n) = open.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::Quota;

    #[test]
    fn a_key_holds_at_most_its_cap_and_others_are_counted_apart() {
        let quota = Arc::new(Quota::default());
        let a: Vec<_> = (0..3).map(|_| quota.take(&"a", 3).expect("room")).collect();
        assert!(quota.take(&"a", 3).is_none(), "a is full");
        let b = quota.take(&"b", 3).expect("b has its own places");
        assert_eq!((quota.held(&"a"), quota.held(&"b")), (3, 1));
        drop(a.into_iter().next());
        assert!(quota.take(&"a", 3).is_some(), "a place came back");
        drop(b);
        assert_eq!(quota.held(&"b"), 0);
    }

    #[test]
    fn keys_holding_nothing_are_not_kept() {
        let quota = Arc::new(Quota::default());
        let places: Vec<_> = (0..100).map(|i| quota.take(&i, 1).expect("room")).collect();
        assert!(!quota.is_empty());
        drop(places);
        assert!(quota.is_empty());
    }
}
