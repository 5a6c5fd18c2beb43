//! The fleet's links as listings read them (ListLinks, a fan-out's plan).
//!
//! A listing reads every link in the store, whatever the caller's tenant,
//! and a dashboard polls it: at 10,000 links one ListLinks took about
//! 80 ms of CPU. Three things follow. It runs on a
//! [background](crate::background) thread, at most [`listings`] at once,
//! so the runtime's workers go on forwarding calls meanwhile and, where the
//! cores are busy, are served first. While the store's version of the links has not moved (no
//! write since, by this replica or, once in its copy, another), the last
//! listing is read again without a scan, so a small tenant's listing on a
//! large hub costs a walk over shared records, not the store. And after a
//! change each record is decoded once: the store's bytes are compared
//! with those of the last listing, which costs a fraction of decoding them
//! again.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, PoisonError},
};

use tokio::sync::Semaphore;
use tonic::Status;

use crate::{
    Result,
    link_service::LinkRecord,
    server::HubState,
    store::{Store, tree},
};

/// Listings under way at once: as many as the background threads, so
/// however many dashboards poll, listings leave room for other background
/// work's turn. The others wait their turn without a thread.
fn listings() -> usize {
    crate::background::threads_count()
}

/// Decoded links and the bounds of listing them.
#[derive(Debug)]
pub struct Links {
    memo: Mutex<Memo>,
    listing: Arc<Semaphore>,
}

#[derive(Debug, Default)]
struct Memo {
    /// Counts listings: a record no listing saw last time is gone.
    generation: u64,
    by_cluster: HashMap<String, Decoded>,
    /// The last listing, at the store's version of the links before it.
    last: Option<(u64, Listing)>,
}

/// Every link, in key order, shared by the listings that read it.
pub type Listing = Arc<Vec<Arc<LinkRecord>>>;

#[derive(Debug)]
struct Decoded {
    /// The store's bytes the record was decoded from.
    raw: Box<[u8]>,
    record: Arc<LinkRecord>,
    generation: u64,
}

impl Default for Links {
    fn default() -> Self {
        Self::with_places(listings())
    }
}

impl Links {
    /// Every link in `store`, in key order. While the store says the links
    /// have not changed, the last listing itself; otherwise a record whose
    /// bytes changed since the last listing (or that is new) is decoded,
    /// the others are the records decoded then.
    pub fn all(&self, store: &dyn Store) -> Result<Listing> {
        let mut memo = self.memo.lock().unwrap_or_else(PoisonError::into_inner);
        // Taken before the scan: a write during it moves the number again.
        let version = store.version(tree::LINKS);
        if let (Some(now), Some((then, listing))) = (version, &memo.last)
            && now == *then
        {
            return Ok(listing.clone());
        }
        memo.generation += 1;
        let Memo {
            generation,
            by_cluster,
            last,
        } = &mut *memo;
        *last = None;
        let mut out = Vec::with_capacity(by_cluster.len());
        store.for_each_raw(tree::LINKS, &mut |key, raw| {
            let record = match by_cluster.get_mut(key) {
                Some(kept) if *kept.raw == *raw => {
                    kept.generation = *generation;
                    kept.record.clone()
                }
                _ => {
                    let record: Arc<LinkRecord> =
                        Arc::new(crate::store::decode(tree::LINKS, key, raw)?);
                    by_cluster.insert(
                        key.to_owned(),
                        Decoded {
                            raw: raw.into(),
                            record: record.clone(),
                            generation: *generation,
                        },
                    );
                    record
                }
            };
            out.push(record);
            Ok(())
        })?;
        if by_cluster.len() > out.len() {
            by_cluster.retain(|_, d| d.generation == *generation);
        }
        let out = Arc::new(out);
        *last = version.map(|v| (v, out.clone()));
        Ok(out)
    }

    /// How many decoded records are kept (what the last listing saw).
    #[cfg(test)]
    fn kept(&self) -> usize {
        let memo = self.memo.lock().unwrap_or_else(PoisonError::into_inner);
        memo.by_cluster.len()
    }
}

/// Runs `view` over every link on a listing thread, in `owner`'s turn (the
/// caller's name), after waiting (without one) for a listing's place.
pub async fn read<T, F>(state: &Arc<HubState>, owner: &str, view: F) -> Result<T, Status>
where
    T: Send + 'static,
    F: FnOnce(&Arc<HubState>, &[Arc<LinkRecord>]) -> T + Send + 'static,
{
    let s = state.clone();
    state
        .links
        .off_the_workers(owner, move || {
            let all = s.links.all(&*s.store).map_err(|e| e.into_status())?;
            Ok(view(&s, &all))
        })
        .await?
}

impl Links {
    fn with_places(places: usize) -> Self {
        Self {
            memo: Mutex::default(),
            listing: Arc::new(Semaphore::new(places)),
        }
    }

    /// Runs `work` on a background thread, in `owner`'s turn, once a
    /// listing's place is free.
    async fn off_the_workers<T: Send + 'static>(
        &self,
        owner: &str,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, Status> {
        let place = self
            .listing
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| Status::unavailable("the hub is shutting down"))?;
        // The place goes with the work: a caller that goes away does not
        // free it while its listing still runs.
        crate::background::run(owner, move || {
            let _place = place;
            work()
        })
        .await
        .map_err(|_| Status::internal("listing links failed"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{SledStore, StoreExt};

    fn link(cluster: &str, version: &str) -> LinkRecord {
        LinkRecord {
            cluster: cluster.into(),
            agent_version: version.into(),
            ..crate::link_service::tests::link()
        }
    }

    /// A store holding links `a` and `b`, and a listing of none yet.
    fn links_a_and_b() -> (tempfile::TempDir, SledStore, Links) {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        store.put(tree::LINKS, "a", &link("a", "1")).unwrap();
        store.put(tree::LINKS, "b", &link("b", "1")).unwrap();
        (dir, store, Links::default())
    }

    #[test]
    fn a_listing_decodes_only_what_changed_and_forgets_what_is_gone() {
        let (_dir, store, links) = links_a_and_b();
        let first = links.all(&store).unwrap();
        assert_eq!(first.len(), 2);

        // Unchanged: the very records of the first listing.
        let second = links.all(&store).unwrap();
        assert!(Arc::ptr_eq(&first[0], &second[0]) && Arc::ptr_eq(&first[1], &second[1]));

        // Changed, added and removed records are read from the store.
        store.put(tree::LINKS, "b", &link("b", "2")).unwrap();
        store.put(tree::LINKS, "c", &link("c", "1")).unwrap();
        store.delete(tree::LINKS, "a").unwrap();
        let third = links.all(&store).unwrap();
        let names: Vec<_> = third
            .iter()
            .map(|l| (l.cluster.as_str(), l.agent_version.as_str()))
            .collect();
        assert_eq!(names, [("b", "2"), ("c", "1")]);
        assert_eq!(links.kept(), 2, "the removed link is forgotten");
    }

    /// While nothing writes the links, a listing is the last one itself
    /// (no scan); any write to them, alone or in a transaction with other
    /// trees, makes the next listing read the store, where unchanged
    /// records are still the ones decoded before.
    #[test]
    fn an_unchanged_store_is_listed_without_a_scan_and_any_write_to_the_links_is_seen() {
        let (_dir, store, links) = links_a_and_b();
        let first = links.all(&store).unwrap();
        assert!(Arc::ptr_eq(&first, &links.all(&store).unwrap()));
        store.put_raw(tree::META, "other", b"1").unwrap();
        assert!(store.writable());
        assert!(
            Arc::ptr_eq(&first, &links.all(&store).unwrap()),
            "writes to other trees leave the listing as it was"
        );
        let versions = |l: &Listing| -> Vec<String> {
            l.iter()
                .map(|r| format!("{}={}", r.cluster, r.agent_version))
                .collect()
        };
        let b2 = serde_json::to_vec(&link("b", "2")).unwrap();
        let swapped = store
            .compare_and_swap_all(&[
                crate::store::Swap::new(
                    tree::LINKS,
                    "b",
                    store.get_raw(tree::LINKS, "b").unwrap(),
                    Some(b2),
                ),
                crate::store::Swap::new(tree::META, "x", None, Some(b"1".to_vec())),
            ])
            .unwrap();
        assert!(swapped);
        let second = links.all(&store).unwrap();
        assert_eq!(versions(&second), ["a=1", "b=2"]);
        assert!(
            Arc::ptr_eq(&first[0], &second[0]),
            "a was not decoded again"
        );
        let b3 = serde_json::to_vec(&link("b", "3")).unwrap();
        let old = store.get_raw(tree::LINKS, "b").unwrap();
        assert!(
            store
                .compare_and_swap_raw(tree::LINKS, "b", old.as_deref(), Some(&b3))
                .unwrap()
        );
        assert_eq!(versions(&links.all(&store).unwrap()), ["a=1", "b=3"]);
        store.delete(tree::LINKS, "a").unwrap();
        assert_eq!(versions(&links.all(&store).unwrap()), ["b=3"]);
    }

    #[test]
    fn a_record_that_no_longer_decodes_fails_the_listing() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        let links = Links::default();
        store.put(tree::LINKS, "a", &link("a", "1")).unwrap();
        links.all(&store).unwrap();
        store.put_raw(tree::LINKS, "a", b"{not json").unwrap();
        assert!(links.all(&store).is_err());
    }

    /// Listings run on the background threads, nicer than the runtime's
    /// workers, and may start tasks (a diagnosis refresh).
    #[tokio::test]
    async fn a_listing_runs_on_a_background_thread() {
        let links = Links::with_places(2);
        for _ in 0..4 {
            let (name, spawned) = links
                .off_the_workers("", move || {
                    let name = std::thread::current().name().map(str::to_owned);
                    (name, tokio::spawn(async { 1 + 1 }))
                })
                .await
                .unwrap();
            assert_eq!(name.as_deref(), Some("hub-background"));
            assert_eq!(
                spawned.await.unwrap(),
                2,
                "a listing starts tasks on the runtime"
            );
        }
    }

    /// A listing that panics fails its own call; the thread goes on to the
    /// next one.
    #[tokio::test]
    async fn a_listing_that_panics_fails_its_call_and_the_next_one_runs() {
        let links = Links::with_places(1);
        let failed = links
            .off_the_workers("", || -> u8 { panic!("a listing gone wrong") })
            .await
            .unwrap_err();
        assert_eq!(failed.code(), tonic::Code::Internal);
        assert_eq!(links.off_the_workers("", || 7u8).await.unwrap(), 7);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_listing_keeps_its_place_until_it_ends_even_when_its_caller_goes_away() {
        let links = Arc::new(Links::with_places(1));
        let (started, mut starts) = tokio::sync::mpsc::unbounded_channel();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let first = {
            let (links, started) = (links.clone(), started.clone());
            tokio::spawn(async move {
                links
                    .off_the_workers("", move || {
                        let _ = started.send("first");
                        let _ = released.recv();
                    })
                    .await
            })
        };
        assert_eq!(starts.recv().await, Some("first"));
        // Its caller goes away while the listing runs.
        first.abort();
        let second = {
            let links = links.clone();
            tokio::spawn(async move {
                links
                    .off_the_workers("", move || {
                        let _ = started.send("second");
                    })
                    .await
            })
        };
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert!(
            starts.try_recv().is_err(),
            "a second listing started while the first still ran"
        );
        release.send(()).unwrap();
        assert_eq!(starts.recv().await, Some("second"));
        second.await.unwrap().unwrap();
    }
}
