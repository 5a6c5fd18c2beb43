//! Threads for work that costs milliseconds of CPU and can wait: a listing
//! of the whole fleet, a large answer turned into JSON for a browser.
//!
//! On the runtime's workers such work holds up every tenant's forwarded
//! calls queued behind it: three dashboards listing 2,000 links back to
//! back made a small Get's p99 eight times what it was alone, and the
//! same listings asked in JSON (then 30 ms of transcoding each) thirty
//! times. Here it runs on a few threads of the process, ten nice levels
//! below the workers, so where both want a core the workers come first,
//! and an idle core still serves it in full.
//!
//! The work waiting is served by owner in turn (the caller who asked for
//! it), each owner's in order: one caller's stream of large answers does
//! not queue everyone else's listing behind it.

use std::{
    collections::{HashMap, VecDeque},
    panic::AssertUnwindSafe,
    sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError},
};

/// What a background thread's nice value is above the hub's. At ten the
/// kernel gives it about a tenth of a worker's share while both want the
/// core.
pub const NICENESS: i32 = 10;

/// The work panicked; its thread went on to the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Panicked;

type Job = Box<dyn FnOnce() + Send>;

/// Runs `work` of `owner` (a caller's name; anonymous work is `""`'s) on a
/// background thread, inside the caller's runtime (work may start tasks),
/// and waits for its result without holding a worker. A caller that goes
/// away leaves the work to finish; its result is dropped.
pub async fn run<T: Send + 'static>(
    owner: &str,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Panicked> {
    let (done, result) = tokio::sync::oneshot::channel();
    let runtime = tokio::runtime::Handle::current();
    let job: Job = Box::new(move || {
        let _runtime = runtime.enter();
        if let Ok(out) = std::panic::catch_unwind(AssertUnwindSafe(work)) {
            let _ = done.send(out);
        }
    });
    match threads() {
        Some(queue) => queue.push(owner, job),
        // No thread could start: the work runs here rather than not at all.
        None => job(),
    }
    result.await.map_err(|_| Panicked)
}

/// Half the cores (at least one): however much background work waits,
/// the other half is left to the workers.
pub fn threads_count() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
}

/// The work waiting for a background thread: each owner's in the order
/// given, the owners in turn.
#[derive(Default)]
struct Waiting {
    jobs: HashMap<String, VecDeque<Job>>,
    /// The owners with work waiting, each once, whose turn comes first
    /// first.
    turns: VecDeque<String>,
}

impl Waiting {
    fn push(&mut self, owner: &str, job: Job) {
        match self.jobs.get_mut(owner) {
            Some(queue) => queue.push_back(job),
            None => {
                self.jobs.insert(owner.to_owned(), VecDeque::from([job]));
                self.turns.push_back(owner.to_owned());
            }
        }
    }

    /// The next owner's first job; that owner's turn comes again after the
    /// others' if it has more.
    fn pop(&mut self) -> Option<Job> {
        let owner = self.turns.pop_front()?;
        let queue = self.jobs.get_mut(&owner)?;
        let job = queue.pop_front();
        if queue.is_empty() {
            self.jobs.remove(&owner);
        } else {
            self.turns.push_back(owner);
        }
        job
    }
}

struct Queue {
    waiting: Mutex<Waiting>,
    added: Condvar,
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn push(&self, owner: &str, job: Job) {
        self.lock().push(owner, job);
        self.added.notify_one();
    }

    /// The next job, once there is one.
    fn next(&self) -> Job {
        let mut waiting = self.lock();
        loop {
            if let Some(job) = waiting.pop() {
                return job;
            }
            waiting = self
                .added
                .wait(waiting)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// The queue of the background threads, started the first time; `None`
/// if none could start.
fn threads() -> Option<&'static Queue> {
    static QUEUE: OnceLock<Option<&'static Queue>> = OnceLock::new();
    *QUEUE.get_or_init(|| {
        let queue: &'static Queue = Box::leak(Box::new(Queue {
            waiting: Mutex::default(),
            added: Condvar::new(),
        }));
        let mut started = 0;
        for _ in 0..threads_count() {
            let spawned = std::thread::Builder::new()
                .name("hub-background".into())
                .spawn(move || {
                    lower_priority();
                    loop {
                        // The lock is released before the job runs.
                        let job = queue.next();
                        job();
                    }
                });
            match spawned {
                Ok(_) => started += 1,
                Err(e) => tracing::error!(error = %e, "cannot start a background thread"),
            }
        }
        (started > 0).then_some(queue)
    })
}

/// Makes the calling thread [`NICENESS`] nicer than it is (any process may
/// lower its own threads' priority). Where it cannot, the work still runs,
/// at the runtime's priority.
fn lower_priority() {
    use rustix::{
        process::{getpriority_process, setpriority_process},
        thread::gettid,
    };
    let me = Some(gettid());
    let now = getpriority_process(me).unwrap_or(0);
    if let Err(e) = setpriority_process(me, (now + NICENESS).min(19)) {
        tracing::debug!(error = %e, "background threads keep the hub's CPU priority");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Background work runs on threads nicer than the runtime's, inside
    /// the caller's runtime.
    #[tokio::test]
    async fn work_runs_at_a_lower_cpu_priority_than_the_workers() {
        use rustix::{process::getpriority_process, thread::gettid};
        let nice = || getpriority_process(Some(gettid())).unwrap();
        let here = nice();
        for _ in 0..4 {
            let (there, name, spawned) = run("", move || {
                let name = std::thread::current().name().map(str::to_owned);
                (nice(), name, tokio::spawn(async { 1 + 1 }))
            })
            .await
            .unwrap();
            assert_eq!(there, (here + NICENESS).min(19));
            assert_eq!(name.as_deref(), Some("hub-background"));
            assert_eq!(
                spawned.await.unwrap(),
                2,
                "work starts tasks on the runtime"
            );
        }
        assert_eq!(nice(), here, "the caller's thread keeps its priority");
    }

    /// Work that panics fails its own caller; the threads go on.
    #[tokio::test]
    async fn work_that_panics_fails_its_caller_and_the_next_runs() {
        for _ in 0..=threads_count() {
            assert_eq!(
                run("", || -> u8 { panic!("gone wrong") }).await,
                Err(Panicked)
            );
        }
        assert_eq!(run("", || 7u8).await, Ok(7));
    }

    /// Owners take turns: work asked after another owner's five waits for
    /// one of them, not for all five.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn owners_take_turns() {
        use std::sync::{
            Arc,
            atomic::{AtomicUsize, Ordering},
        };
        async fn until(what: &str, done: impl Fn() -> bool) {
            for _ in 0..2_000 {
                if done() {
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            panic!("{what}: not within 10 s");
        }
        // Every background thread held until the work below is queued.
        let (release, held) = std::sync::mpsc::channel::<()>();
        let held = Arc::new(Mutex::new(held));
        let holding = Arc::new(AtomicUsize::new(0));
        let holders = futures::future::join_all((0..threads_count()).map(|_| {
            let (held, holding) = (held.clone(), holding.clone());
            run("holder", move || {
                holding.fetch_add(1, Ordering::SeqCst);
                let _ = held.lock().unwrap().recv();
            })
        }));
        let holders = tokio::spawn(holders);
        until("the threads held", || {
            holding.load(Ordering::SeqCst) == threads_count()
        })
        .await;
        // Queued in this order by one task's first poll.
        let started = Arc::new(Mutex::new(Vec::new()));
        let work = [
            ("a", "a1"),
            ("a", "a2"),
            ("a", "a3"),
            ("a", "a4"),
            ("a", "a5"),
            ("b", "b1"),
        ]
        .map(|(owner, name)| {
            let started = started.clone();
            run(owner, move || started.lock().unwrap().push(name))
        });
        let work = tokio::spawn(futures::future::join_all(work));
        until("the work queued", || {
            threads().unwrap().lock().jobs.contains_key("b")
        })
        .await;
        for _ in 0..threads_count() {
            release.send(()).unwrap();
        }
        for done in holders
            .await
            .unwrap()
            .into_iter()
            .chain(work.await.unwrap())
        {
            done.unwrap();
        }
        let order = started.lock().unwrap().clone();
        let at = |name| order.iter().position(|n| *n == name).unwrap();
        assert!(at("b1") < at("a2"), "{order:?}");
        assert_eq!(order.len(), 6, "{order:?}");
    }
}
