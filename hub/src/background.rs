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

use std::{
    panic::AssertUnwindSafe,
    sync::{Mutex, OnceLock, PoisonError, mpsc},
};

/// What a background thread's nice value is above the hub's. At ten the
/// kernel gives it about a tenth of a worker's share while both want the
/// core.
pub const NICENESS: i32 = 10;

/// The work panicked; its thread went on to the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Panicked;

type Job = Box<dyn FnOnce() + Send>;

/// Runs `work` on a background thread, inside the caller's runtime (work
/// may start tasks), and waits for its result without holding a worker.
/// A caller that goes away leaves the work to finish; its result is
/// dropped.
pub async fn run<T: Send + 'static>(
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
    // The threads never end, so the queue's receiver is never dropped;
    // if none could start, the work runs here rather than not at all.
    match threads().send(job) {
        Ok(()) => result.await.map_err(|_| Panicked),
        Err(mpsc::SendError(job)) => {
            job();
            result.await.map_err(|_| Panicked)
        }
    }
}

/// Half the cores (at least one): however much background work waits,
/// the other half is left to the workers.
pub fn threads_count() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
}

/// The queue of the background threads, started the first time.
fn threads() -> &'static mpsc::Sender<Job> {
    static QUEUE: OnceLock<mpsc::Sender<Job>> = OnceLock::new();
    QUEUE.get_or_init(|| {
        let (jobs, queue) = mpsc::channel::<Job>();
        let queue: &'static Mutex<mpsc::Receiver<Job>> = Box::leak(Box::new(Mutex::new(queue)));
        let mut started = 0;
        for _ in 0..threads_count() {
            let spawned = std::thread::Builder::new()
                .name("hub-background".into())
                .spawn(move || {
                    lower_priority();
                    loop {
                        // The lock ends with this statement: no thread holds
                        // it while a job runs.
                        let next = queue.lock().unwrap_or_else(PoisonError::into_inner).recv();
                        let Ok(job) = next else { break };
                        job();
                    }
                });
            match spawned {
                Ok(_) => started += 1,
                Err(e) => tracing::error!(error = %e, "cannot start a background thread"),
            }
        }
        if started == 0 {
            // A queue no one reads fails every send: `run` then does the
            // work on the caller's thread.
            return mpsc::channel().0;
        }
        jobs
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
            let (there, name, spawned) = run(move || {
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
            assert_eq!(run(|| -> u8 { panic!("gone wrong") }).await, Err(Panicked));
        }
        assert_eq!(run(|| 7u8).await, Ok(7));
    }
}
