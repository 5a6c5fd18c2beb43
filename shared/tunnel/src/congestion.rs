//! quinn's BBR, held steady through its round-trip probe and bounded to
//! the path's delivery rate.
//!
//! BBR (v1, as quinn has it) drops its window to three quarters of its
//! estimate of the path's bandwidth-delay product for 200 ms whenever it
//! sends at full rate and has not probed for 10 s: at the first bulk
//! transfer of a tunnel, at the first after a quiet spell, and every 10 s
//! of a long one. After a quiet spell that estimate is a keepalive's, so
//! the window falls to four datagrams: a port-forward through the hub over
//! QUIC ran its first 32 MiB at about 125 MB/s and the next at 600-750.
//! In BBR the probe lets the sender measure the path's minimum round trip
//! afresh; quinn's takes that from the connection's lifetime minimum
//! whatever the probe sees, so here the probe only slows the sender.
//! [`SteadyBbr`] keeps the window BBR had before a probe until the probe is
//! over, or until a loss says the path has less room.
//!
//! quinn's BBR leaves its start-up only on acknowledgements of a sender
//! that is not app-limited, and quinn counts a connection app-limited
//! whenever its last attempt to send found nothing to send and no window
//! in the way. A tunnel's sender mostly is: its bytes come from calls whose
//! own bounds (a stream's window, a port-forward's 4 MiB queue) run out
//! before the connection's window does. So BBR stayed in start-up, where
//! its window grows by every byte acknowledged and no loss lowers it: to
//! 140 MB over a 100 ms, 100 Mbit/s link, with 4 MiB in flight on a path
//! that holds 1.25 MB and queues as much again. The link's full queue
//! dropped 15 % of the hub's datagrams (TCP under HTTP/2, 4 %). So
//! [`SteadyBbr`] measures the path's delivery rate itself ([`Delivery`]),
//! and once the rate stops growing (BBR's own rule) or a loss with a
//! queue behind it shows the path full, bounds the window to what that
//! rate sends in the path's least round trip and a tenth more
//! ([`RATE_WINDOW_GAIN`]): the queue it keeps is a tenth of a round trip
//! at most, and the spare tenth is how the rate finds more room. On that
//! link 1,088 of 301,881 datagrams were dropped (with a quarter more). Where the round trip is short the bound is never less
//! than [`RATE_WINDOW_FLOOR`] of sending at that rate: there
//! acknowledgements come in bursts that a window of one round trip would
//! not cover, and a queue of a few milliseconds costs little.
//!
//! A loss alone does not show the path full: on a path that drops one
//! datagram in a hundred at random, nearly every round trip has one, at
//! whatever rate the calls send. Counting those spans as the path's rate
//! bound the window to an app-limited rate, and a Connect upload at 1 %
//! loss trailed HTTP/2. A full path queues before it drops, so a loss
//! counts only in a span whose smoothed round trip grew by a quarter over
//! the least ([`QUEUED`]).

use std::{
    any::Any,
    sync::Arc,
    time::{Duration, Instant},
};

use quinn::congestion::{BbrConfig, Controller, ControllerFactory, ControllerMetrics};
use quinn_proto::RttEstimator;

/// How long after its last probe quinn's BBR probes again, at the first
/// acknowledgement of a full-rate send.
const PROBE_AFTER: Duration = Duration::from_secs(10);

/// How long a window is held from the start of a probe: the probe's
/// 200 ms and the round trip that ends it, with room for long paths.
const HOLD_FOR: Duration = Duration::from_secs(1);

/// The window over the path's delivery rate times its least round trip:
/// a tenth to spare, which is also how the rate finds more room.
///
/// A call beside a transfer that fills the path waits behind what the
/// spare keeps queued at the path's bottleneck. Over the bench's distant
/// link (100 ms, 100 Mbit/s), a Get beside a Connect download took 127 ms
/// at p50 with a quarter to spare and 112 with a tenth (102 alone), the
/// transfers' rates the same within their spread at 0, 1 and 5 % loss.
/// The cost: a window bound too low (a rate measured from small calls)
/// grows back by a tenth per round trip instead of a quarter.
const RATE_WINDOW_GAIN: f64 = 1.1;

/// The least window, as a time of sending at the path's delivery rate.
const RATE_WINDOW_FLOOR: Duration = Duration::from_millis(4);

/// Spans of delivery the rate is the best of (each at least a round trip).
const SPANS: usize = 10;

/// A span lasts at least this, however short the round trip: over
/// loopback acknowledgements come in bursts.
const SPAN_FLOOR: Duration = Duration::from_millis(1);

/// The rate has found the path's bandwidth once it grew by less than
/// this over [`FLAT_SPANS`] spans in a row (BBR's own rule for leaving
/// its start-up).
const GROWTH: f64 = 1.25;
const FLAT_SPANS: u32 = 3;

/// A round trip this much above the path's least, as a share of it,
/// shows a queue at the path's bottleneck; never less than
/// [`QUEUED_FLOOR`], as a short path's round trip jitters by more.
const QUEUED: f64 = 0.25;
const QUEUED_FLOOR: Duration = Duration::from_millis(1);

/// Builds [`SteadyBbr`] controllers.
#[derive(Debug, Default)]
pub struct SteadyBbrConfig(Arc<BbrConfig>);

impl ControllerFactory for SteadyBbrConfig {
    fn build(self: Arc<Self>, now: Instant, current_mtu: u16) -> Box<dyn Controller> {
        Box::new(SteadyBbr::new(self.0.clone().build(now, current_mtu)))
    }
}

/// A congestion controller that is `inner` (quinn's BBR) except during
/// its round-trip probes, with its window bounded to what the path's
/// delivery rate sends (see the module's notes).
pub struct SteadyBbr {
    inner: Box<dyn Controller>,
    /// When `inner` last started a probe, as its own rule has it.
    last_probe: Option<Instant>,
    /// The window held, and until when.
    hold: Option<(u64, Instant)>,
    /// The time of the latest event seen (`window` is asked without one).
    now: Option<Instant>,
    /// When a loss was last reported.
    last_loss: Option<Instant>,
    /// The path's least round trip seen.
    min_rtt: Option<Duration>,
    /// Bytes acknowledged since quinn last ended a batch of
    /// acknowledgements.
    acked: u64,
    delivery: Delivery,
}

/// The rate at which the path delivers, as bytes acknowledged over spans
/// of at least a round trip. quinn's BBR keeps its own estimate as the
/// highest rate between two acknowledgements or two sends it ever saw,
/// which one burst of acknowledgements inflates for the connection's life.
#[derive(Debug, Clone, Default)]
struct Delivery {
    /// When the span under way started.
    start: Option<Instant>,
    /// Bytes acknowledged in it.
    acked: u64,
    /// Whether any of them were sent while the sender had nothing more
    /// to send: such a span says nothing of the path, unless ...
    limited: bool,
    /// ... a loss in it ...
    lost: bool,
    /// ... while a queue grew at the bottleneck says the sender had
    /// reached the path's limit; or the sender had its whole window out
    /// (quinn flags a sender its pacer holds as app-limited, so a window
    /// at the bound's floor would never count and never grow).
    queued: bool,
    filled: bool,
    /// The last spans' rates, bytes per second, oldest first, and the
    /// best of them (kept as spans close: quinn asks for the window
    /// several times per datagram it sends).
    rates: std::collections::VecDeque<f64>,
    best: f64,
    /// The best rate when it last grew by [`GROWTH`], and spans since.
    plateau: f64,
    flat: u32,
    /// The rate has found the path's bandwidth.
    full: bool,
}

impl Delivery {
    /// `rtt` is the smoothed round trip as of this acknowledgement.
    fn on_ack(
        &mut self,
        now: Instant,
        bytes: u64,
        app_limited: bool,
        rtt: Duration,
        min_rtt: Duration,
    ) {
        // The first acknowledgement starts the first span; its bytes were
        // sent before it.
        let Some(start) = self.start else {
            self.start = Some(now);
            return;
        };
        self.acked += bytes;
        self.limited |= app_limited;
        self.queued |= rtt >= min_rtt + min_rtt.mul_f64(QUEUED).max(QUEUED_FLOOR);
        let span = now.saturating_duration_since(start);
        if span < min_rtt.max(SPAN_FLOOR) {
            return;
        }
        let overflowed = self.lost && self.queued;
        if !self.limited || self.filled || overflowed {
            self.push(self.acked as f64 / span.as_secs_f64());
        }
        if overflowed {
            self.full = true;
        }
        self.start = Some(now);
        self.acked = 0;
        self.limited = false;
        self.lost = false;
        self.queued = false;
        self.filled = false;
    }

    fn on_loss(&mut self) {
        self.lost = true;
    }

    fn push(&mut self, rate: f64) {
        if self.rates.len() == SPANS {
            self.rates.pop_front();
        }
        self.rates.push_back(rate);
        self.best = self.rates.iter().copied().fold(0.0, f64::max);
        if self.full {
            return;
        }
        if self.best >= self.plateau * GROWTH {
            self.plateau = self.best;
            self.flat = 0;
        } else {
            self.flat += 1;
            self.full = self.flat >= FLAT_SPANS;
        }
    }

    /// The window that sends at the path's rate, once that is found.
    fn bound(&self, min_rtt: Duration) -> Option<u64> {
        self.full.then(|| {
            (self.best * RATE_WINDOW_GAIN * min_rtt.max(RATE_WINDOW_FLOOR).as_secs_f64()) as u64
        })
    }
}

impl std::fmt::Debug for SteadyBbr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SteadyBbr")
            .field("window", &self.window())
            .field("last_probe", &self.last_probe)
            .field("hold", &self.hold)
            .finish_non_exhaustive()
    }
}

impl SteadyBbr {
    pub fn new(inner: Box<dyn Controller>) -> Self {
        Self {
            inner,
            last_probe: None,
            hold: None,
            now: None,
            last_loss: None,
            min_rtt: None,
            acked: 0,
            delivery: Delivery::default(),
        }
    }

    fn held(&self) -> Option<u64> {
        let (window, until) = self.hold?;
        (self.now? < until).then_some(window)
    }

    /// The window that sends at the path's delivery rate (see the
    /// module's notes), once that is found; never below the window a
    /// connection starts with.
    fn rate_bound(&self) -> Option<u64> {
        let bound = self.delivery.bound(self.min_rtt?)?;
        Some(bound.max(self.inner.initial_window()))
    }
}

impl Controller for SteadyBbr {
    fn on_sent(&mut self, now: Instant, bytes: u64, last_packet_number: u64) {
        self.now = Some(now);
        self.inner.on_sent(now, bytes, last_packet_number);
    }

    fn on_ack(
        &mut self,
        now: Instant,
        sent: Instant,
        bytes: u64,
        app_limited: bool,
        rtt: &RttEstimator,
    ) {
        self.now = Some(now);
        self.min_rtt = Some(rtt.min());
        self.acked += bytes;
        self.delivery
            .on_ack(now, bytes, app_limited, rtt.get(), rtt.min());
        self.inner.on_ack(now, sent, bytes, app_limited, rtt);
    }

    fn on_end_acks(
        &mut self,
        now: Instant,
        in_flight: u64,
        app_limited: bool,
        largest_packet_num_acked: Option<u64>,
    ) {
        self.now = Some(now);
        // What was in flight before these acknowledgements: a sender with
        // its whole window out (an eighth spare) was held by the window.
        let before = in_flight + std::mem::take(&mut self.acked);
        let window = self.window();
        if before >= window - window / 8 {
            self.delivery.filled = true;
        }
        // BBR's rule for starting a probe, read before it acts on it.
        let probes = !app_limited
            && self
                .last_probe
                .is_none_or(|last| now.saturating_duration_since(last) > PROBE_AFTER);
        // Not right after a loss: then BBR's recovery rules the window.
        let held = probes
            && self
                .last_loss
                .is_none_or(|lost| now.saturating_duration_since(lost) > HOLD_FOR);
        let before = self.window();
        // BBR ends a probe 200 ms after its bytes in flight have fallen to
        // the probe's window; with the window held they never would, and
        // the probe would only come later. Told none are in flight as it
        // starts, it sets its 200 ms going at once.
        let in_flight = if held { 0 } else { in_flight };
        self.inner
            .on_end_acks(now, in_flight, app_limited, largest_packet_num_acked);
        if probes {
            self.last_probe = Some(now);
        }
        if held {
            // Never below what a new connection starts with.
            let window = before.max(self.inner.initial_window());
            self.hold = Some((window, now + HOLD_FOR));
        }
    }

    fn on_congestion_event(
        &mut self,
        now: Instant,
        sent: Instant,
        is_persistent_congestion: bool,
        lost_bytes: u64,
    ) {
        self.now = Some(now);
        // A loss is the path's word: BBR's own window rules from here.
        self.hold = None;
        self.last_loss = Some(now);
        self.delivery.on_loss();
        self.inner
            .on_congestion_event(now, sent, is_persistent_congestion, lost_bytes);
    }

    fn on_mtu_update(&mut self, new_mtu: u16) {
        self.inner.on_mtu_update(new_mtu);
    }

    fn window(&self) -> u64 {
        let window = self.inner.window();
        let window = self.held().map_or(window, |held| held.max(window));
        self.rate_bound().map_or(window, |bound| window.min(bound))
    }

    fn metrics(&self) -> ControllerMetrics {
        let mut metrics = self.inner.metrics();
        metrics.congestion_window = self.window();
        metrics
    }

    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(Self {
            inner: self.inner.clone_box(),
            last_probe: self.last_probe,
            hold: self.hold,
            now: self.now,
            last_loss: self.last_loss,
            min_rtt: self.min_rtt,
            acked: self.acked,
            delivery: self.delivery.clone(),
        })
    }

    fn initial_window(&self) -> u64 {
        self.inner.initial_window()
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// BBR's window as far as probes go: from a full-rate acknowledgement
    /// 10 s after the last probe, `PROBE` until 200 ms after the bytes in
    /// flight fell below it; `NORMAL` otherwise, or `AFTER_LOSS` once a
    /// loss was reported.
    #[derive(Clone, Default)]
    struct Fake {
        probe_started: Option<Instant>,
        probing: bool,
        ends_at: Option<Instant>,
        now: Option<Instant>,
        lost: bool,
    }

    const NORMAL: u64 = 2_000_000;
    const PROBE: u64 = 36_000;
    const AFTER_LOSS: u64 = 100_000;
    const INITIAL: u64 = 240_000;

    impl Controller for Fake {
        fn on_sent(&mut self, now: Instant, _: u64, _: u64) {
            self.now = Some(now);
        }
        fn on_end_acks(&mut self, now: Instant, in_flight: u64, app_limited: bool, _: Option<u64>) {
            self.now = Some(now);
            if !self.probing
                && !app_limited
                && self
                    .probe_started
                    .is_none_or(|t| now.saturating_duration_since(t) > PROBE_AFTER)
            {
                self.probe_started = Some(now);
                self.probing = true;
                self.ends_at = None;
            }
            if self.probing {
                match self.ends_at {
                    None if in_flight < PROBE => self.ends_at = Some(now + ms(200)),
                    Some(end) if now >= end => self.probing = false,
                    _ => {}
                }
            }
        }
        fn on_congestion_event(&mut self, now: Instant, _: Instant, _: bool, _: u64) {
            self.now = Some(now);
            self.lost = true;
        }
        fn on_mtu_update(&mut self, _: u16) {}
        fn window(&self) -> u64 {
            if self.lost {
                AFTER_LOSS
            } else if self.probing {
                PROBE
            } else {
                NORMAL
            }
        }
        fn clone_box(&self) -> Box<dyn Controller> {
            Box::new(self.clone())
        }
        fn initial_window(&self) -> u64 {
            INITIAL
        }
        fn into_any(self: Box<Self>) -> Box<dyn Any> {
            self
        }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A megabyte in flight throughout: a bulk transfer.
    const BULK: u64 = 1_000_000;

    #[test]
    fn a_probe_keeps_the_window_and_still_ends() {
        let t0 = Instant::now();
        let mut cc = SteadyBbr::new(Box::new(Fake::default()));
        // Acknowledgements of a quiet tunnel's keepalives start no probe.
        cc.on_end_acks(t0, 0, true, Some(1));
        assert_eq!(cc.window(), NORMAL);
        // The first full-rate send does; the window stays.
        cc.on_end_acks(t0 + ms(5), BULK, false, Some(2));
        assert_eq!(cc.inner.window(), PROBE, "BBR probes");
        assert_eq!(cc.window(), NORMAL);
        cc.on_sent(t0 + ms(150), 1200, 3);
        assert_eq!(cc.window(), NORMAL);
        // BBR's probe ends 200 ms on although the bytes in flight never
        // fell (it was told none were, as it began).
        cc.on_end_acks(t0 + ms(300), BULK, false, Some(3));
        assert_eq!(cc.inner.window(), NORMAL, "BBR's probe is over");
        assert_eq!(cc.window(), NORMAL);
        // 5 s on, no probe; 11 s on, the next, held again.
        cc.on_end_acks(t0 + ms(5_000), BULK, false, Some(4));
        assert_eq!(cc.inner.window(), NORMAL);
        cc.on_end_acks(t0 + ms(11_000), BULK, false, Some(5));
        assert_eq!(cc.inner.window(), PROBE);
        assert_eq!(cc.window(), NORMAL);
    }

    #[test]
    fn a_probe_from_a_small_window_is_held_at_the_initial_one() {
        // A window below the initial one before the probe (a stale
        // estimate after a quiet spell) is held at the initial window.
        let small = Fake {
            lost: true,
            ..Fake::default()
        };
        let mut cc = SteadyBbr::new(Box::new(small));
        cc.on_end_acks(Instant::now(), BULK, false, Some(1));
        assert_eq!(cc.window(), INITIAL);
    }

    #[test]
    fn a_loss_ends_the_hold_and_a_probe_right_after_one_is_bbrs() {
        let t0 = Instant::now();
        let mut cc = SteadyBbr::new(Box::new(Fake::default()));
        cc.on_end_acks(t0, BULK, false, Some(1));
        assert_eq!(cc.window(), NORMAL);
        cc.on_congestion_event(t0 + ms(50), t0 + ms(40), false, 1200);
        assert_eq!(cc.window(), AFTER_LOSS);

        let mut cc = SteadyBbr::new(Box::new(Fake::default()));
        cc.on_congestion_event(t0, t0, false, 1200);
        cc.inner = Box::new(Fake::default());
        cc.on_end_acks(t0 + ms(10), BULK, false, Some(1));
        assert_eq!(cc.window(), PROBE);
    }

    #[test]
    fn the_hold_ends_on_its_own() {
        let t0 = Instant::now();
        let mut cc = SteadyBbr::new(Box::new(Fake::default()));
        cc.on_end_acks(t0, BULK, false, Some(1));
        assert_eq!(cc.window(), NORMAL);
        // Were BBR still probing 1 s on, its window would be the one.
        cc.inner = Box::new(Fake {
            probing: true,
            ..Fake::default()
        });
        cc.on_sent(t0 + HOLD_FOR + ms(1), 1200, 2);
        assert_eq!(cc.window(), PROBE);
    }

    /// A path's acknowledgements: `rate` bytes per second for `secs`,
    /// every 5 ms, from `t`; where they end.
    fn deliver(cc: &mut SteadyBbr, t: Instant, rate: f64, secs: f64, app_limited: bool) -> Instant {
        let min_rtt = cc.min_rtt.expect("a round trip");
        deliver_with(cc, t, rate, secs, app_limited, min_rtt)
    }

    /// As [`deliver`], with the smoothed round trip at `rtt`.
    fn deliver_with(
        cc: &mut SteadyBbr,
        t: Instant,
        rate: f64,
        secs: f64,
        app_limited: bool,
        rtt: Duration,
    ) -> Instant {
        let step = ms(5);
        let per_ack = (rate * step.as_secs_f64()) as u64;
        let min_rtt = cc.min_rtt.expect("a round trip");
        let mut now = t;
        for _ in 0..(secs / step.as_secs_f64()) as u64 {
            now += step;
            cc.delivery.on_ack(now, per_ack, app_limited, rtt, min_rtt);
        }
        now
    }

    fn over(rtt: Duration) -> SteadyBbr {
        let mut cc = SteadyBbr::new(Box::new(Fake::default()));
        cc.min_rtt = Some(rtt);
        cc
    }

    #[test]
    fn once_the_rate_is_found_the_window_sends_it_in_a_round_trip_and_a_tenth() {
        // 10 MB/s over 100 ms: BBR's own window (2 MB here) would keep
        // twice the 1 MB in flight that the path holds.
        let mut cc = over(ms(100));
        let t = deliver(&mut cc, Instant::now(), 10e6, 0.25, false);
        assert_eq!(cc.window(), NORMAL, "not found yet: BBR's window");
        let t = deliver(&mut cc, t, 10e6, 1.0, false);
        let window = cc.window();
        assert!((1_090_000..=1_110_000).contains(&window), "{window}");
        // A quiet spell (keepalives only) does not lower it.
        let t = deliver(&mut cc, t, 1e3, 5.0, true);
        assert_eq!(cc.window(), window);
        // A path that delivers half as much has it halved, ten spans on.
        deliver(&mut cc, t, 5e6, 1.5, false);
        let halved = cc.window();
        assert!((535_000..=565_000).contains(&halved), "{halved}");
    }

    #[test]
    fn a_growing_rate_leaves_the_window_to_bbr() {
        // Doubling every round trip, as in BBR's start-up.
        let mut cc = over(ms(100));
        let mut t = Instant::now();
        let mut rate = 1e5;
        for _ in 0..12 {
            t = deliver(&mut cc, t, rate, 0.1, false);
            rate *= 2.0;
        }
        assert_eq!(cc.window(), NORMAL);
    }

    #[test]
    fn over_a_short_path_the_window_covers_a_few_milliseconds_and_the_initial_window() {
        // 1 GB/s over loopback (50 µs): 4 ms of it, 4.4 MB with the spare
        // tenth, is above BBR's own window, which stays.
        let mut cc = over(Duration::from_micros(50));
        deliver(&mut cc, Instant::now(), 1e9, 0.1, false);
        assert_eq!(cc.window(), NORMAL);
        // 1 MB/s over 1 ms: 4 ms of it is 4.4 kB, below what a connection
        // starts with, which it gets.
        let mut cc = over(ms(1));
        deliver(&mut cc, Instant::now(), 1e6, 0.1, false);
        assert_eq!(cc.window(), INITIAL);
    }

    #[test]
    fn a_window_at_the_floor_grows_though_its_sender_looks_app_limited() {
        // The bound found a near-zero rate (a span of small calls with a
        // loss behind a queue): the window is the floor, the initial one.
        let mut cc = over(ms(100));
        let t = deliver(&mut cc, Instant::now(), 1e3, 0.005, true);
        cc.on_congestion_event(t, t, false, 1200);
        cc.inner = Box::new(Fake::default());
        let mut t = deliver_with(&mut cc, t, 1e3, 0.1, true, ms(130));
        assert_eq!(cc.window(), INITIAL);
        // A transfer then keeps that window in flight, paced, so quinn
        // flags it app-limited: each round trip delivers the window, and
        // the window grows by its spare tenth (thirty round trips take it
        // from 0.24 MB past 2 MB).
        for _ in 0..30 {
            let window = cc.window();
            cc.on_end_acks(t, window, true, None);
            t = deliver(&mut cc, t, window as f64 / 0.1, 0.1, true);
        }
        // Up past the bound, to BBR's own window.
        assert_eq!(cc.window(), NORMAL);
    }

    #[test]
    fn a_loss_behind_a_queue_makes_a_span_the_sender_did_not_fill_count() {
        // A tunnel's sender is app-limited in quinn's eyes while a call's
        // own bound holds its bytes back; such spans say nothing...
        let mut cc = over(ms(100));
        // (The first acknowledgement starts the first span: from here each
        // 100 ms delivered is one span.)
        let t = deliver(&mut cc, Instant::now(), 10e6, 0.005, true);
        let t = deliver(&mut cc, t, 10e6, 1.0, true);
        assert_eq!(cc.window(), NORMAL);
        // ... nor do they with a loss but no queue: a path that drops at
        // random, at whatever rate the calls send ...
        let mut t = t;
        for _ in 0..10 {
            cc.on_congestion_event(t, t, false, 1200);
            t = deliver(&mut cc, t, 2e6, 0.1, true);
        }
        cc.inner = Box::new(Fake::default());
        assert_eq!(cc.window(), NORMAL, "random losses bound nothing");
        // ... until a loss while the round trip grew says the path was
        // full at that rate.
        cc.on_congestion_event(t, t, false, 1200);
        assert!(cc.delivery.lost);
        cc.inner = Box::new(Fake::default());
        deliver_with(&mut cc, t, 10e6, 0.1, true, ms(130));
        let window = cc.window();
        assert!((1_090_000..=1_110_000).contains(&window), "{window}");
    }
}
