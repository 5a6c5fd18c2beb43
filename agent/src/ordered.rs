//! The writes of one port-forward upload, in the order the hub queued them.
//!
//! The upstream `WritePortForward` carries no sequence number, so a hub
//! far from the cluster that waited for each write's answer before sending
//! the next would pay a round trip per batch. The hub sends a few at once
//! instead, each naming its upload path and place in it
//! ([`otter_tunnel::frame::UPLOAD_ORDER_HEADER`]); they may arrive in any
//! order (each is a tunnel stream of its own), and each goes to the pod
//! only after the one before it. A write whose predecessor failed, or
//! never came within the wait, fails too: the pod never sees a stream with
//! a hole in it.

use std::{
    sync::{Mutex, PoisonError},
    time::Duration,
};

use tokio::{sync::Notify, time::Instant};
use tonic::Status;

/// A write's place: its upload path (the hub draws one per path) and its
/// number on that path, from 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub upload: u64,
    pub seq: u64,
}

impl Place {
    /// From the header's `<upload>/<seq>` (both hexadecimal).
    pub fn parse(value: &str) -> Option<Place> {
        let (upload, seq) = value.split_once('/')?;
        Some(Place {
            upload: u64::from_str_radix(upload, 16).ok()?,
            seq: u64::from_str_radix(seq, 16).ok()?,
        })
    }
}

/// Where a session's ordered upload stands.
#[derive(Debug, Default)]
pub struct Order {
    state: Mutex<State>,
    turned: Notify,
}

#[derive(Debug, Default)]
struct State {
    /// The upload path being followed (None before its first write).
    upload: Option<u64>,
    /// The write whose turn it is.
    next: u64,
    /// A write of this path failed or was abandoned midway.
    broken: bool,
    /// The write whose turn it is has it now.
    held: bool,
}

/// A write's turn; ends it when dropped, as failed unless
/// [`Turn::finish`] said otherwise (a write whose call was cancelled may
/// or may not have reached the pod).
#[derive(Debug)]
pub struct Turn<'a> {
    order: &'a Order,
    place: Place,
    ok: bool,
}

impl Order {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits, at most `wait`, until the writes before `place` are done.
    pub async fn turn(&self, place: Place, wait: Duration) -> Result<Turn<'_>, Status> {
        let deadline = Instant::now() + wait;
        loop {
            let turned = self.turned.notified();
            tokio::pin!(turned);
            // Registered before the state is read: a turn ending between
            // the read and the wait still wakes this one.
            turned.as_mut().enable();
            {
                let mut s = self.lock();
                // A new path starts at its first write (the hub opens one
                // after the last went idle).
                if place.seq == 0 && s.upload != Some(place.upload) {
                    *s = State {
                        upload: Some(place.upload),
                        ..State::default()
                    };
                }
                if s.upload == Some(place.upload) {
                    if s.broken {
                        return Err(Status::aborted(
                            "an earlier write of this port-forward upload failed",
                        ));
                    }
                    if s.next == place.seq && !s.held {
                        s.held = true;
                        return Ok(Turn {
                            order: self,
                            place,
                            ok: false,
                        });
                    }
                    if place.seq < s.next {
                        return Err(Status::already_exists(format!(
                            "write {} of this port-forward upload came twice",
                            place.seq
                        )));
                    }
                }
            }
            if tokio::time::timeout_at(deadline, turned).await.is_err() {
                return Err(Status::aborted(
                    "an earlier write of this port-forward upload did not come",
                ));
            }
        }
    }
}

impl Turn<'_> {
    /// Ends the turn: the next write goes on if this one's bytes were
    /// queued for the pod, else the path is broken.
    pub fn finish(mut self, ok: bool) {
        self.ok = ok;
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        {
            let mut s = self.order.lock();
            if s.upload == Some(self.place.upload) && s.next == self.place.seq {
                s.held = false;
                if self.ok {
                    s.next += 1;
                } else {
                    s.broken = true;
                }
            }
        }
        self.order.turned.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    const WAIT: Duration = Duration::from_secs(5);

    fn at(upload: u64, seq: u64) -> Place {
        Place { upload, seq }
    }

    #[test]
    fn places_parse_from_the_header_and_nothing_else_does() {
        assert_eq!(Place::parse("ff/1a"), Some(at(255, 26)));
        for bad in ["", "ff", "ff/", "/1", "x/1", "1/2/3", "1/-2"] {
            assert_eq!(Place::parse(bad), None, "{bad:?}");
        }
    }

    /// Writes arriving in reverse order reach the pod in their own.
    #[tokio::test]
    async fn writes_go_in_their_order_whatever_order_they_come_in() {
        let order = Arc::new(Order::default());
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        for seq in (0..8).rev() {
            let (order, tx) = (order.clone(), tx.clone());
            tasks.push(tokio::spawn(async move {
                let turn = order.turn(at(7, seq), WAIT).await.unwrap();
                tx.send(seq).unwrap();
                turn.finish(true);
            }));
            tokio::task::yield_now().await;
        }
        for t in tasks {
            t.await.unwrap();
        }
        drop(tx);
        let mut got = Vec::new();
        while let Some(s) = rx.recv().await {
            got.push(s);
        }
        assert_eq!(got, (0..8).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn after_a_failed_or_abandoned_write_the_rest_fail() {
        let order = Order::default();
        order.turn(at(1, 0), WAIT).await.unwrap().finish(false);
        let e = order.turn(at(1, 1), WAIT).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Aborted, "{e:?}");

        // Abandoned midway: the call was cancelled holding its turn.
        let order = Order::default();
        drop(order.turn(at(2, 0), WAIT).await.unwrap());
        let e = order.turn(at(2, 1), WAIT).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Aborted, "{e:?}");
        // A new path starts afresh.
        order.turn(at(3, 0), WAIT).await.unwrap().finish(true);
        order.turn(at(3, 1), WAIT).await.unwrap().finish(true);
    }

    #[tokio::test]
    async fn a_write_whose_predecessor_never_comes_fails_after_the_wait() {
        let order = Order::default();
        order.turn(at(1, 0), WAIT).await.unwrap().finish(true);
        let e = order
            .turn(at(1, 2), Duration::from_millis(50))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Aborted, "{e:?}");
        let e = order.turn(at(1, 0), WAIT).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::AlreadyExists, "{e:?}");
    }
}
