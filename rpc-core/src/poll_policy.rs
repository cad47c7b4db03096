//! How a polling loop waits when it finds nothing to do: spin while it has a core to itself,
//! back off when it does not. One detector for every loop that polls a completion queue (the
//! server's shards, the client's poller thread, callers that drive their own connection).
//!
//! Spinning pays only while the spinner owns a core. On a shared host (more runnable threads
//! than cores) the scheduler takes the core away for a time slice, milliseconds: a spinner
//! then keeps a core from the threads that have work (the peer that must answer, the caller
//! that must read the answer), and each of them waits a slice for it. A sleeper woken by an
//! event gets its core back at once (the scheduler favours threads that slept). So a loop that
//! sees it has no core to itself spins only briefly and then sleeps on its completion channel
//! and doorbell, the sleep paths it already has.
//!
//! How it notices, without a system call on the quiet path:
//! - **Clock gaps while spinning.** The loop reads the clock (`Instant`, a vDSO call) every
//!   [`CLOCK_EVERY`] idle turns. A few idle turns take microseconds (tens in a debug build);
//!   a gap over [`PREEMPTED`] between two reads means the thread was off its core. The first
//!   read of an idle phase is only a reference point, so the time between two phases (the
//!   work done in between) is never taken for a gap; a phase shorter than [`CLOCK_EVERY`]
//!   turns reads no clock at all.
//! - **A gap that ends the idle phase.** Past [`CLOCK_EVERY`] idle turns the loop reads the
//!   clock at the top of every turn ([`Spinner::before_turn`]): a thread preempted while it
//!   spins usually finds its work waiting when it is back, and that turn's gap counts too.
//! - **Late wake-ups.** A sleep that returns [`PREEMPTED`] later than it asked for (measured
//!   by the caller around a call that is a system call anyway). Yields are not timed: beside
//!   a runnable CPU-bound thread one gives the core away until the next scheduler tick, and
//!   the work that came meanwhile ends the idle phase before a clock gap shows it (a 1 MiB
//!   blocking call under background load waits a tick so; see `benches/HISTORY.md`).
//!
//! Not every preemption means a busy host. Short ones (hundreds of microseconds: a process
//! starting its threads, another tenant's burst) come now and then on any shared machine; a
//! shard that took one for contention slept between requests for the next 100 ms (the
//! in-process greeter, a newcomer's first run, was ten times slower one run in three). So a
//! quiet loop is contended by a preemption of a whole time slice ([`SLICE`]: a CPU-bound
//! thread shares its core), or by shorter ones once they add up to a quarter
//! ([`LOST_SHARE`]) of [`LOST_WINDOW`]. A loop that was contended a moment ago is again at
//! its next preemption, whatever its length.
//!
//! A spinner also keeps a core it shares from a thread that has work. Beside a thread that
//! sleeps most of the time (a server's acceptor task, the tokio worker a poller woke, a
//! process's control thread) a spinning loop is not preempted: the woken thread waits for the
//! spinner's time slice to end, milliseconds, and the spinner sees no gap, since it never lost
//! its core. The thread it holds up is often the one that brings its next work (an acceptor
//! that reads a Hello before the shard can set the connection up). So a quiet loop that has
//! spun for [`GIVE_WAY`] yields once ([`Budget::give_way`]), and again every [`GIVE_WAY`]: a
//! woken thread beside it waits that long at most. A yield with no other thread runnable is a
//! short system call; an idle phase shorter than [`GIVE_WAY`] (a loop answering calls back to
//! back) makes none.
//!
//! Once it noticed, the loop is *contended* for a while ([`CONTENDED_FOR`], doubled up to
//! [`MAX_CONTENDED_FOR`] when contention comes back right after it ended): it spins only
//! [`Budget::contended_spin`] turns, then sleeps; longer (up to [`CONTENDED_LINGER_MAX`]) while
//! its work keeps coming as it spins, which happens when its peer has another core (see
//! [`Spinner::work`]): there a sleep costs a wake-up the scheduler may serve a time slice
//! late. With no new evidence it returns to full
//! spinning when that time is up, so a quiet host gets full spinning back within
//! [`MAX_CONTENDED_FOR`].
//!
//! [`Spinner`] is a plain state machine: it is given the clock (a closure, read only when it
//! needs it) and returns what to do; the tests drive it with synthetic clocks.

use std::time::{Duration, Instant};

/// A spinning loop reads the clock every this many idle turns.
pub(crate) const CLOCK_EVERY: u32 = 16;

/// A gap this long between two clock reads of a spinning loop, or a yield or sleep that
/// returns this much later than asked, means the scheduler took the core.
pub(crate) const PREEMPTED: Duration = Duration::from_micros(200);

/// A preemption this long took a whole time slice: a CPU-bound thread shares the core (the
/// scheduler's tick is 1-4 ms). One is enough to make a loop contended.
pub(crate) const SLICE: Duration = Duration::from_millis(2);

/// The window over which a quiet loop adds up the shorter preemptions it saw.
pub(crate) const LOST_WINDOW: Duration = Duration::from_millis(50);

/// The share of [`LOST_WINDOW`] a quiet loop must lose to preemptions to be contended, as a
/// divisor: a quarter.
pub(crate) const LOST_SHARE: u32 = 4;

/// How long a loop that was preempted stays contended (spins only briefly).
pub(crate) const CONTENDED_FOR: Duration = Duration::from_millis(100);

/// The longest contended period: contention seen again within one period of the last one's
/// end doubles the next, up to this.
pub(crate) const MAX_CONTENDED_FOR: Duration = Duration::from_millis(1600);

/// A quiet loop that spins this long without work yields once, and again each time this much
/// more has passed (see the module docs).
pub(crate) const GIVE_WAY: Duration = Duration::from_micros(20);

/// Idle turns a contended loop spins before it sleeps: enough for two clock reads, so a
/// contended phase can renew the evidence.
pub(crate) const CONTENDED_SPIN: u32 = 2 * CLOCK_EVERY;

/// The most idle turns a contended loop spins before it sleeps once its work has been coming
/// while it spun (see [`Spinner::work`]): about the gap between two calls of a caller on
/// another core (tens of microseconds).
pub(crate) const CONTENDED_LINGER_MAX: u32 = 16 * CONTENDED_SPIN;

const _: () = assert!(CONTENDED_SPIN >= 2 * CLOCK_EVERY);
const _: () = assert!(CONTENDED_FOR.as_nanos() < MAX_CONTENDED_FOR.as_nanos());
const _: () = assert!(PREEMPTED.as_nanos() * 10 < CONTENDED_FOR.as_nanos());

/// What a loop does on an idle turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wait {
    /// `std::hint::spin_loop()` and look again.
    Spin,
    /// Give the core to another thread (`std::thread::yield_now()`), then look again.
    Yield,
    /// Sleep on the loop's completion channel and doorbell (or, for a loop that has none, a
    /// short sleep), then tell the spinner with [`Spinner::woke`].
    Sleep,
}

/// How long a loop spins and yields on a quiet host, and spins on a contended one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Budget {
    /// Idle turns spinning on a quiet host (`u32::MAX`: forever).
    pub(crate) spin: u32,
    /// Then idle turns yielding before it sleeps (`u32::MAX`: never sleeps on a quiet host).
    pub(crate) yields: u32,
    /// Idle turns spinning on a contended host, before it sleeps (no yields: a yield on a
    /// contended core gives it away for a time slice).
    pub(crate) contended_spin: u32,
    /// Whether a quiet loop spinning for [`GIVE_WAY`] yields once (see the module docs).
    pub(crate) give_way: bool,
}

impl Budget {
    /// Spin forever on a quiet host (`ShardPolling::Busy`).
    pub(crate) const BUSY: Budget = Budget {
        spin: u32::MAX,
        yields: 0,
        contended_spin: CONTENDED_SPIN,
        give_way: true,
    };

    /// Spin, yield a little, then sleep (`ShardPolling::Adaptive`, the poller thread).
    pub(crate) const fn adaptive(spin: u32, yields: u32) -> Budget {
        Budget {
            spin,
            yields,
            contended_spin: CONTENDED_SPIN,
            give_way: true,
        }
    }
}

/// The detector's state for one polling thread (see the module docs). `Copy` and small: a
/// thread keeps it across calls (blocking callers, in a thread-local).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Spinner {
    /// Idle turns of this idle phase (0: the next idle turn starts one).
    idle: u32,
    /// Idle turns since the last clock read.
    since_clock: u32,
    /// The last clock read of this phase.
    last: Option<Instant>,
    /// Contended until then (as of the last clock read).
    until: Option<Instant>,
    /// Whether `until` was in the future at the last clock read (no clock read needed to know
    /// it between reads).
    contended: bool,
    /// The current contended period.
    hold: Duration,
    /// Time a quiet loop lost to preemptions since `window` began (see [`LOST_WINDOW`]).
    lost: Duration,
    /// When the current window began (its first preemption).
    window: Option<Instant>,
    /// When this idle phase last gave way (or its first clock read).
    gave_way: GiveWay,
    /// A clock read happened since the last idle turn looked at `gave_way`.
    fresh: bool,
    /// Idle turns a contended loop spins before it sleeps, at least its budget's
    /// `contended_spin`: twice the idle turns after which work last came while it spun,
    /// halved when it slept (see [`Spinner::work`]).
    linger: u32,
    /// Idle phases begun (every [`PROBE_EVERY`]th contended one lingers the longest).
    phases: u32,
    /// The loop was contended when this idle phase began.
    phase_contended: bool,
}

/// Every this many idle phases a contended loop spins up to [`CONTENDED_LINGER_MAX`] turns
/// before it sleeps, to learn whether work comes while it spins.
pub(crate) const PROBE_EVERY: u32 = 16;

impl Default for Spinner {
    fn default() -> Self {
        Spinner::new()
    }
}

impl Spinner {
    /// A spinner on a host not (yet) seen contended.
    pub(crate) const fn new() -> Spinner {
        Spinner {
            idle: 0,
            since_clock: 0,
            last: None,
            until: None,
            contended: false,
            hold: CONTENDED_FOR,
            lost: Duration::ZERO,
            window: None,
            gave_way: GiveWay::new(),
            fresh: false,
            linger: CONTENDED_SPIN,
            phases: 0,
            phase_contended: false,
        }
    }

    /// The loop did work: the next idle turn starts a new idle phase.
    ///
    /// A contended loop whose work came while it spun lingers next time for twice the idle
    /// turns it took (up to [`CONTENDED_LINGER_MAX`]); one that had to sleep (see
    /// [`Spinner::idle`]) half as long as before, and every [`PROBE_EVERY`]th phase spins the
    /// longest to find out whether work comes meanwhile. When its peer runs on another core,
    /// each beside a busy thread, the peer's next message comes while it spins: a sleep there
    /// costs a wake-up that the scheduler may serve a time slice late (milliseconds;
    /// `benches/HISTORY.md`, "The 64 KiB p99 under load"). When the peer shares its core,
    /// nothing comes while it spins (the peer cannot run), so it goes on sleeping at once but
    /// for the probes, and does not hold its peer up.
    pub(crate) fn work(&mut self) {
        if self.phase_contended && self.idle > 0 {
            self.linger = self
                .linger
                .max(self.idle.saturating_mul(2))
                .min(CONTENDED_LINGER_MAX);
        }
        self.idle = 0;
    }

    /// Called at the top of every turn of a loop, before it looks for work. Once the idle
    /// phase is [`CLOCK_EVERY`] turns long it reads the clock at every turn: a preemption
    /// that ends the phase (the work came while the thread was off its core, and the turn
    /// after finds it) then shows as a gap too. [`Spinner::idle`]'s reads alone miss it: the
    /// phase ends before the next of them. The gap between two turn starts holds one idle
    /// turn and the time off the core, never the work of the turn that found some.
    pub(crate) fn before_turn(&mut self, clock: impl FnOnce() -> Instant) {
        if self.idle < CLOCK_EVERY {
            return;
        }
        self.read_clock(clock);
    }

    /// A clock read of an idle phase: a gap over [`PREEMPTED`] since the last one was a
    /// preemption.
    fn read_clock(&mut self, clock: impl FnOnce() -> Instant) {
        self.since_clock = 0;
        self.fresh = true;
        let now = clock();
        match self.last {
            Some(last) if now.saturating_duration_since(last) > PREEMPTED => {
                self.preempted(now, now.saturating_duration_since(last));
            }
            _ => self.refresh(now),
        }
        self.last = Some(now);
    }

    /// Whether the loop counts as contended (as of its last clock read).
    #[cfg(test)]
    pub(crate) fn is_contended(&self) -> bool {
        self.contended
    }

    /// One idle turn under `budget`: what to do now. `clock` is called every
    /// [`CLOCK_EVERY`] idle turns, never more often.
    pub(crate) fn idle(&mut self, budget: &Budget, clock: impl FnOnce() -> Instant) -> Wait {
        if self.idle == 0 {
            self.last = None;
            self.since_clock = 0;
            self.gave_way = GiveWay::new();
            self.fresh = false;
            self.phases = self.phases.wrapping_add(1);
            self.phase_contended = self.contended;
        }
        self.idle = self.idle.saturating_add(1);
        self.since_clock += 1;
        if self.since_clock >= CLOCK_EVERY {
            self.read_clock(clock);
        }
        // At most once per clock read (here or in `before_turn`).
        if std::mem::take(&mut self.fresh)
            && budget.give_way
            && !self.contended
            && self.idle <= budget.spin
            && self.give_way()
        {
            return Wait::Yield;
        }
        if self.contended {
            let linger = if self.phases.is_multiple_of(PROBE_EVERY) {
                CONTENDED_LINGER_MAX
            } else {
                self.linger
            };
            if self.idle <= budget.contended_spin.max(linger) {
                Wait::Spin
            } else {
                self.linger = (self.linger / 2).max(budget.contended_spin);
                Wait::Sleep
            }
        } else if self.idle <= budget.spin {
            Wait::Spin
        } else if self.idle - budget.spin <= budget.yields {
            Wait::Yield
        } else {
            Wait::Sleep
        }
    }

    /// At a clock read of a quiet spinning phase: whether [`GIVE_WAY`] passed since the phase's
    /// first read or its last yield.
    fn give_way(&mut self) -> bool {
        match self.last {
            Some(now) => self.gave_way.due(now, now),
            None => false,
        }
    }

    /// The loop slept (or yielded) from `started` to `now`, asking for at most `asked`: a
    /// return [`PREEMPTED`] later than that is a late wake-up, evidence of contention. Starts
    /// a new idle phase.
    pub(crate) fn woke(&mut self, started: Instant, asked: Duration, now: Instant) {
        self.idle = 0;
        let took = now.saturating_duration_since(started);
        if took > asked.saturating_add(PREEMPTED) {
            self.preempted(now, took.saturating_sub(asked));
        } else {
            self.refresh(now);
        }
    }

    /// The loop was off its core for about `lost` until `now`.
    fn preempted(&mut self, now: Instant, lost: Duration) {
        // Contended now or a moment ago, or a time slice lost at once: this preemption is
        // enough. Shorter ones make a quiet loop contended once they add up to
        // LOST_WINDOW / LOST_SHARE within LOST_WINDOW.
        let recent = self
            .until
            .is_some_and(|until| now < until || now.saturating_duration_since(until) < self.hold);
        if !recent && lost < SLICE {
            match self.window {
                Some(t) if now.saturating_duration_since(t) <= LOST_WINDOW => {
                    self.lost = self.lost.saturating_add(lost);
                }
                _ => {
                    self.window = Some(now.checked_sub(lost).unwrap_or(now));
                    self.lost = lost;
                }
            }
            if self.lost < LOST_WINDOW / LOST_SHARE {
                self.refresh(now);
                return;
            }
        }
        self.lost = Duration::ZERO;
        self.window = None;
        self.hold = match self.until {
            // Still contended: renew for the same period.
            Some(until) if now < until => self.hold,
            // Back right after it ended: the host is busy for longer than one period.
            Some(until) if now.saturating_duration_since(until) < self.hold => {
                self.hold.saturating_mul(2).min(MAX_CONTENDED_FOR)
            }
            _ => CONTENDED_FOR,
        };
        self.until = Some(now + self.hold);
        self.contended = true;
    }

    fn refresh(&mut self, now: Instant) {
        self.contended = self.until.is_some_and(|t| now < t);
    }
}

/// When a quiet idle phase last gave way: it yields [`GIVE_WAY`] after its first clock read,
/// then every [`GIVE_WAY`] (the bookkeeping [`Spinner`] and [`TimedSpin`] share).
#[derive(Clone, Copy, Debug)]
struct GiveWay(Option<Instant>);

impl GiveWay {
    /// A new idle phase: no clock read yet.
    const fn new() -> GiveWay {
        GiveWay(None)
    }

    /// At the clock read `now` of a phase whose first read was `first`: whether to yield now
    /// (then the next yield is due [`GIVE_WAY`] later).
    fn due(&mut self, first: Instant, now: Instant) -> bool {
        let last = *self.0.get_or_insert(first);
        if now.saturating_duration_since(last) >= GIVE_WAY {
            self.0 = Some(now);
            return true;
        }
        false
    }
}

/// How a loop whose turns are interleaved with other work waits (a task that yields to its
/// runtime between turns): clock gaps say nothing there, since the runtime runs the other
/// tasks in them, so time alone decides. It spins for `spin_for` without work, yielding its
/// thread once every [`GIVE_WAY`] of it, then sleeps; work starts a new phase.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TimedSpin {
    spin_for: Duration,
    /// Idle turns of this phase.
    idle: u32,
    /// The phase's first clock read, and its last yield.
    since: Option<Instant>,
    gave_way: GiveWay,
}

impl TimedSpin {
    pub(crate) const fn new(spin_for: Duration) -> TimedSpin {
        TimedSpin {
            spin_for,
            idle: 0,
            since: None,
            gave_way: GiveWay::new(),
        }
    }

    /// The loop did work (or slept): the next idle turn starts a new phase.
    pub(crate) fn work(&mut self) {
        self.idle = 0;
        self.since = None;
        self.gave_way = GiveWay::new();
    }

    /// One idle turn: what to do now. `clock` is called every [`CLOCK_EVERY`] idle turns.
    pub(crate) fn idle(&mut self, clock: impl FnOnce() -> Instant) -> Wait {
        self.idle = self.idle.saturating_add(1);
        if !self.idle.is_multiple_of(CLOCK_EVERY) {
            return Wait::Spin;
        }
        let now = clock();
        let since = *self.since.get_or_insert(now);
        if now.saturating_duration_since(since) >= self.spin_for {
            return Wait::Sleep;
        }
        if self.gave_way.due(since, now) {
            return Wait::Yield;
        }
        Wait::Spin
    }
}

thread_local! {
    /// The detector of a thread that waits by driving a connection itself (blocking calls,
    /// pipelines): kept across its calls, so that contention seen in one call counts for the
    /// next.
    static THREAD_SPINNER: std::cell::Cell<Spinner> = const { std::cell::Cell::new(Spinner::new()) };
}

thread_local! {
    /// Whether this thread runs a server shard's polling loop.
    static SHARD_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks this thread as a server shard's: code it runs (handlers) must not busy-wait, since
/// the shard's other connections wait meanwhile.
pub(crate) fn mark_shard_thread() {
    SHARD_THREAD.with(|c| c.set(true));
}

/// Whether this thread is a server shard's ([`mark_shard_thread`]).
pub(crate) fn on_shard_thread() -> bool {
    SHARD_THREAD.with(std::cell::Cell::get)
}

/// Runs `f` with this thread's [`Spinner`], starting a new idle phase (no allocation, no
/// system call: a const-initialised thread-local).
pub(crate) fn with_thread_spinner<T>(f: impl FnOnce(&mut Spinner) -> T) -> T {
    let mut s = THREAD_SPINNER.with(std::cell::Cell::get);
    s.work();
    let r = f(&mut s);
    THREAD_SPINNER.with(|c| c.set(s));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A synthetic clock: starts at a real instant, moves only when told.
    struct Clock {
        now: Instant,
        reads: u32,
    }

    impl Clock {
        fn new() -> Clock {
            Clock {
                now: Instant::now(),
                reads: 0,
            }
        }
        fn advance(&mut self, d: Duration) {
            self.now += d;
        }
    }

    /// `n` idle turns, the clock moving `step` per turn; returns the last decision.
    fn turns(s: &mut Spinner, b: &Budget, c: &mut Clock, n: u32, step: Duration) -> Wait {
        let mut w = Wait::Spin;
        for _ in 0..n {
            c.advance(step);
            w = s.idle(b, || {
                c.reads += 1;
                c.now
            });
        }
        w
    }

    const TURN: Duration = Duration::from_nanos(50);

    #[test]
    fn quiet_host_spins_then_yields_then_sleeps() {
        let b = Budget::adaptive(100, 10);
        let (mut s, mut c) = (Spinner::new(), Clock::new());
        assert_eq!(turns(&mut s, &b, &mut c, 100, TURN), Wait::Spin);
        assert_eq!(turns(&mut s, &b, &mut c, 1, TURN), Wait::Yield);
        assert_eq!(turns(&mut s, &b, &mut c, 9, TURN), Wait::Yield);
        assert_eq!(turns(&mut s, &b, &mut c, 1, TURN), Wait::Sleep);
        assert!(!s.is_contended());
        // The clock is read every CLOCK_EVERY turns, no more.
        assert_eq!(c.reads, 111 / CLOCK_EVERY);
        // Work starts a new phase with the full spin budget.
        s.work();
        assert_eq!(turns(&mut s, &b, &mut c, 100, TURN), Wait::Spin);
    }

    #[test]
    fn busy_spins_forever_on_a_quiet_host() {
        let (mut s, mut c) = (Spinner::new(), Clock::new());
        for _ in 0..100 {
            assert_eq!(
                turns(&mut s, &Budget::BUSY, &mut c, 10_000, TURN),
                Wait::Spin
            );
        }
        assert!(!s.is_contended());
    }

    /// The decisions of `n` idle turns, the clock moving `step` per turn.
    fn decisions(s: &mut Spinner, b: &Budget, c: &mut Clock, n: u32, step: Duration) -> Vec<Wait> {
        (0..n).map(|_| turns(s, b, c, 1, step)).collect()
    }

    #[test]
    fn a_long_quiet_spin_gives_way_once_per_give_way() {
        let per_give_way = u32::try_from(GIVE_WAY.as_nanos() / TURN.as_nanos()).unwrap();
        for b in [Budget::BUSY, Budget::adaptive(u32::MAX, 0)] {
            let (mut s, mut c) = (Spinner::new(), Clock::new());
            // 10 GIVE_WAYs of spinning: a yield after each (timed from the phase's first
            // clock read, so 9 or 10), each at a clock read, the rest spins.
            let d = decisions(&mut s, &b, &mut c, 10 * per_give_way, TURN);
            let yields: Vec<usize> = (0..d.len()).filter(|&i| d[i] == Wait::Yield).collect();
            assert!((9..=10).contains(&yields.len()), "{} yields", yields.len());
            assert!(yields.iter().all(|&i| (i + 1) % CLOCK_EVERY as usize == 0));
            assert!(d.iter().all(|w| matches!(w, Wait::Spin | Wait::Yield)));
            assert!(!s.is_contended());
        }
    }

    #[test]
    fn a_loop_that_reads_the_clock_every_turn_gives_way_too() {
        // Past CLOCK_EVERY idle turns `before_turn` reads the clock at every turn, as the
        // shard's and the poller's loops call it.
        let per_give_way = u32::try_from(GIVE_WAY.as_nanos() / TURN.as_nanos()).unwrap();
        let (mut s, mut c) = (Spinner::new(), Clock::new());
        let yields = (0..10 * per_give_way)
            .filter(|_| loop_turns(&mut s, &Budget::BUSY, &mut c, 1) == Wait::Yield)
            .count();
        assert!((9..=10).contains(&yields), "{yields} yields");
    }

    #[test]
    fn idle_phases_shorter_than_give_way_never_yield() {
        let per_give_way = u32::try_from(GIVE_WAY.as_nanos() / TURN.as_nanos()).unwrap();
        let (mut s, mut c) = (Spinner::new(), Clock::new());
        for _ in 0..1000 {
            // A loop answering calls back to back: idle phases of half a GIVE_WAY.
            let d = decisions(&mut s, &Budget::BUSY, &mut c, per_give_way / 2, TURN);
            assert!(d.iter().all(|&w| w == Wait::Spin));
            s.work();
        }
    }

    #[test]
    fn no_give_way_when_the_budget_says_so_or_when_contended() {
        let per_give_way = u32::try_from(GIVE_WAY.as_nanos() / TURN.as_nanos()).unwrap();
        let b = Budget {
            give_way: false,
            ..Budget::BUSY
        };
        let (mut s, mut c) = (Spinner::new(), Clock::new());
        let d = decisions(&mut s, &b, &mut c, 10 * per_give_way, TURN);
        assert!(d.iter().all(|&w| w == Wait::Spin));
        // Contended: a brief spin, then sleep; never a yield (it would give the core away
        // for a time slice).
        let (mut s, mut c) = (Spinner::new(), Clock::new());
        turns(&mut s, &Budget::BUSY, &mut c, CLOCK_EVERY, TURN);
        gap(&mut s, &Budget::BUSY, &mut c, Duration::from_millis(3));
        assert!(s.is_contended());
        s.work();
        let d = decisions(&mut s, &Budget::BUSY, &mut c, 10 * per_give_way, TURN);
        assert!(d.iter().all(|&w| w != Wait::Yield));
    }

    #[test]
    fn a_timed_spin_yields_every_give_way_and_sleeps_when_its_time_is_up() {
        let spin_for = Duration::from_micros(200);
        let (mut t, mut c) = (TimedSpin::new(spin_for), Clock::new());
        let next = |c: &mut Clock, t: &mut TimedSpin| {
            c.advance(TURN);
            t.idle(|| {
                c.reads += 1;
                c.now
            })
        };
        let mut yields = 0;
        let mut turns = 0u32;
        let slept_after = loop {
            turns += 1;
            match next(&mut c, &mut t) {
                Wait::Spin => {}
                Wait::Yield => yields += 1,
                Wait::Sleep => break turns,
            }
            assert!(turns < 1_000_000);
        };
        // 200 µs of 50 ns turns, give or take a clock read; a yield every 20 µs of it.
        let per = u32::try_from(spin_for.as_nanos() / TURN.as_nanos()).unwrap();
        assert!(
            slept_after.abs_diff(per) <= CLOCK_EVERY,
            "slept after {slept_after}"
        );
        assert!((9..=10).contains(&yields), "{yields} yields");
        assert_eq!(c.reads, slept_after / CLOCK_EVERY);
        // Work (or the sleep) starts a new phase with its full time.
        t.work();
        for _ in 0..per / 2 {
            assert_ne!(next(&mut c, &mut t), Wait::Sleep);
        }
    }

    #[test]
    fn a_timed_spin_ignores_the_time_between_its_turns() {
        // Whatever runs between turns (other tasks) only counts as the phase's time: a long
        // gap brings the sleep sooner, never "contention".
        let (mut t, mut c) = (TimedSpin::new(Duration::from_micros(200)), Clock::new());
        for _ in 0..CLOCK_EVERY {
            c.advance(TURN);
            t.idle(|| c.now);
        }
        c.advance(Duration::from_millis(5));
        let mut w = Wait::Spin;
        for _ in 0..CLOCK_EVERY {
            c.advance(TURN);
            w = t.idle(|| c.now);
        }
        assert_eq!(w, Wait::Sleep);
        t.work();
        for _ in 0..CLOCK_EVERY {
            c.advance(TURN);
            w = t.idle(|| c.now);
        }
        assert_eq!(w, Wait::Spin, "a new phase spins again at once");
    }

    #[test]
    fn short_phases_read_no_clock() {
        let b = Budget::BUSY;
        let (mut s, mut c) = (Spinner::new(), Clock::new());
        for _ in 0..1000 {
            turns(&mut s, &b, &mut c, CLOCK_EVERY - 1, TURN);
            s.work();
        }
        assert_eq!(c.reads, 0);
    }

    /// Off the core for `off` in the middle of the next CLOCK_EVERY turns; returns their last
    /// decision.
    fn gap(s: &mut Spinner, b: &Budget, c: &mut Clock, off: Duration) -> Wait {
        c.advance(off);
        turns(s, b, c, CLOCK_EVERY, TURN)
    }

    /// A yield (asked: nothing) that came back `after` later.
    fn late(s: &mut Spinner, c: &mut Clock, after: Duration) {
        let t0 = c.now;
        c.advance(after);
        s.woke(t0, Duration::ZERO, c.now);
    }

    #[test]
    fn a_clock_gap_while_spinning_means_contended() {
        let b = Budget::BUSY;
        let (mut s, mut c) = (Spinner::new(), Clock::new());
        assert_eq!(turns(&mut s, &b, &mut c, 1000, TURN), Wait::Spin);
        // Off the core for 3 ms (a time slice) in the middle of the next CLOCK_EVERY turns.
        let w = gap(&mut s, &b, &mut c, Duration::from_millis(3));
        assert!(s.is_contended());
        assert_eq!(
            w,
            Wait::Sleep,
            "a phase already past the contended budget sleeps"
        );
        // The next phases spin briefly, then sleep.
        s.work();
        assert_eq!(turns(&mut s, &b, &mut c, CONTENDED_SPIN, TURN), Wait::Spin);
        assert_eq!(turns(&mut s, &b, &mut c, 1, TURN), Wait::Sleep);
    }

    /// One contended idle phase whose work comes after `work_after` idle turns (`None`: never):
    /// whether the loop slept before it came. A sleep is taken as woken at once.
    fn contended_phase(
        s: &mut Spinner,
        b: &Budget,
        c: &mut Clock,
        work_after: Option<u32>,
    ) -> bool {
        for i in 1.. {
            if Some(i) == work_after {
                s.work();
                return false;
            }
            if turns(s, b, c, 1, TURN) == Wait::Sleep {
                s.woke(c.now, Duration::ZERO, c.now);
                return true;
            }
            if work_after.is_none() && i > CONTENDED_LINGER_MAX + 1 {
                unreachable!("a contended phase spun past its longest linger");
            }
        }
        unreachable!()
    }

    #[test]
    fn a_contended_loop_lingers_while_its_work_comes_as_it_spins() {
        let b = Budget::BUSY;
        let contended = || {
            let (mut s, mut c) = (Spinner::new(), Clock::new());
            turns(&mut s, &b, &mut c, 1000, TURN);
            gap(&mut s, &b, &mut c, Duration::from_millis(3));
            s.work();
            assert!(s.is_contended());
            (s, c)
        };
        // The peer on another core: its next message comes 100 idle turns into each phase.
        // The loop sleeps first (its budget is 32 turns), until a probe lingers long enough
        // to see the message come; from then on it spins through the gap.
        let (mut s, mut c) = contended();
        let slept: Vec<bool> = (0..3 * PROBE_EVERY)
            .map(|_| contended_phase(&mut s, &b, &mut c, Some(100)))
            .collect();
        let first_caught = slept
            .iter()
            .position(|&x| !x)
            .expect("a probe caught the work");
        assert!(first_caught < PROBE_EVERY as usize, "{slept:?}");
        assert!(slept[first_caught..].iter().all(|&x| !x), "{slept:?}");
        assert!(s.is_contended());

        // The peer on this core: nothing comes while the loop spins. It sleeps after its
        // budget but for one probe in PROBE_EVERY phases.
        let (mut s, mut c) = contended();
        let mut spun = 0;
        for _ in 0..2 * PROBE_EVERY {
            let before = c.now;
            assert!(contended_phase(&mut s, &b, &mut c, None));
            spun += u32::try_from((c.now - before).as_nanos() / TURN.as_nanos()).unwrap();
        }
        let most = 2 * PROBE_EVERY * (CONTENDED_SPIN + 1) + 2 * CONTENDED_LINGER_MAX;
        assert!(spun <= most, "spun {spun} turns, at most {most}");
    }

    #[test]
    fn short_preemptions_are_not_contention_until_they_add_up() {
        let b = Budget::BUSY;
        let short = Duration::from_micros(500);
        let enough = (LOST_WINDOW / LOST_SHARE).as_micros() / short.as_micros();
        // A process starting its threads, another tenant's burst: preempted briefly, then
        // quiet. Never enough within one window, however long it goes on.
        let (mut s, mut c) = (Spinner::new(), Clock::new());
        for _ in 0..100 {
            s.work();
            turns(&mut s, &b, &mut c, CLOCK_EVERY, TURN);
            // Quiet: it goes on spinning (it may give way once: the gap outlasts GIVE_WAY).
            assert_ne!(gap(&mut s, &b, &mut c, short), Wait::Sleep);
            c.advance(Duration::from_millis(10));
        }
        assert!(!s.is_contended());
        // Many within one window add up.
        let (mut s, mut c) = (Spinner::new(), Clock::new());
        turns(&mut s, &b, &mut c, CLOCK_EVERY, TURN);
        for _ in 1..enough {
            assert_ne!(gap(&mut s, &b, &mut c, short), Wait::Sleep);
        }
        assert!(!s.is_contended());
        gap(&mut s, &b, &mut c, short);
        assert!(s.is_contended());
        // Late wake-ups count the same.
        let (mut s, mut c) = (Spinner::new(), Clock::new());
        for _ in 1..enough {
            late(&mut s, &mut c, short);
        }
        assert!(!s.is_contended());
        late(&mut s, &mut c, short);
        assert!(s.is_contended());
    }

    /// A loop's turns as the loops run them: `before_turn`, then (idle) `idle`.
    fn loop_turns(s: &mut Spinner, b: &Budget, c: &mut Clock, n: u32) -> Wait {
        let mut w = Wait::Spin;
        for _ in 0..n {
            c.advance(TURN);
            s.before_turn(|| {
                c.reads += 1;
                c.now
            });
            w = s.idle(b, || {
                c.reads += 1;
                c.now
            });
        }
        w
    }

    #[test]
    fn a_preemption_that_ends_the_phase_is_seen() {
        let b = Budget::BUSY;
        let (mut s, mut c) = (Spinner::new(), Clock::new());
        // Spinning for an answer, off the core for a time slice, and back to find it.
        for _ in 0..3 {
            loop_turns(&mut s, &b, &mut c, 2 * CLOCK_EVERY);
            c.advance(SLICE + TURN);
            s.before_turn(|| c.now);
            s.work();
        }
        assert!(s.is_contended());
        // Short phases read no clock at the top of their turns, and a long one reads it once
        // per turn, no more.
        let (mut s, mut c) = (Spinner::new(), Clock::new());
        loop_turns(&mut s, &b, &mut c, CLOCK_EVERY - 1);
        assert_eq!(c.reads, 0);
        s.work();
        loop_turns(&mut s, &b, &mut c, 3 * CLOCK_EVERY);
        assert_eq!(c.reads, 2 * CLOCK_EVERY + 1);
        assert!(!s.is_contended());
        // The work of the turn that found some is never part of a gap.
        c.advance(Duration::from_micros(1));
        s.before_turn(|| c.now);
        s.work();
        c.advance(SLICE * 2);
        s.before_turn(|| c.now);
        loop_turns(&mut s, &b, &mut c, 2 * CLOCK_EVERY);
        assert!(!s.is_contended());
    }

    #[test]
    fn a_gap_just_under_the_threshold_is_not_contention() {
        let b = Budget::BUSY;
        let (mut s, mut c) = (Spinner::new(), Clock::new());
        turns(&mut s, &b, &mut c, CLOCK_EVERY, TURN);
        c.advance(PREEMPTED - TURN * (CLOCK_EVERY + 1));
        turns(&mut s, &b, &mut c, CLOCK_EVERY, TURN);
        assert!(!s.is_contended());
    }

    #[test]
    fn time_between_phases_is_not_a_gap() {
        let b = Budget::BUSY;
        let (mut s, mut c) = (Spinner::new(), Clock::new());
        for _ in 0..10 {
            turns(&mut s, &b, &mut c, 3 * CLOCK_EVERY, TURN);
            s.work();
            // 10 ms of work (or of waiting for the next call) between two idle phases.
            c.advance(Duration::from_millis(10));
        }
        assert!(!s.is_contended());
    }

    #[test]
    fn contention_ends_when_the_host_is_quiet_again() {
        let b = Budget::adaptive(1000, 0);
        let (mut s, mut c) = (Spinner::new(), Clock::new());
        turns(&mut s, &b, &mut c, CLOCK_EVERY, TURN);
        gap(&mut s, &b, &mut c, SLICE);
        assert!(s.is_contended());
        // Quiet phases (each shorter than the contended budget, then a sleep that was woken
        // in time) for a little less than CONTENDED_FOR: still contended.
        let start = c.now;
        while c.now.duration_since(start) < CONTENDED_FOR - Duration::from_millis(2) {
            s.work();
            turns(&mut s, &b, &mut c, CONTENDED_SPIN, TURN);
            let t0 = c.now;
            c.advance(Duration::from_micros(20));
            s.woke(t0, Duration::from_millis(20), c.now);
        }
        assert!(s.is_contended());
        c.advance(Duration::from_millis(3));
        s.work();
        assert_eq!(turns(&mut s, &b, &mut c, CLOCK_EVERY, TURN), Wait::Spin);
        assert!(!s.is_contended());
        assert_eq!(
            turns(&mut s, &b, &mut c, 1000 - CLOCK_EVERY, TURN),
            Wait::Spin
        );
        assert_eq!(turns(&mut s, &b, &mut c, 1, TURN), Wait::Sleep);
    }

    #[test]
    fn a_late_wake_up_means_contended() {
        let (mut s, mut c) = (Spinner::new(), Clock::new());
        // A yield (asked: nothing) that came back after a time slice.
        late(&mut s, &mut c, SLICE);
        assert!(s.is_contended());

        let (mut s, mut c) = (Spinner::new(), Clock::new());
        // A 20 ms sleep that ran its full time, and one woken early: not late.
        let t0 = c.now;
        c.advance(Duration::from_millis(20) + PREEMPTED / 2);
        s.woke(t0, Duration::from_millis(20), c.now);
        let t0 = c.now;
        c.advance(Duration::from_micros(5));
        s.woke(t0, Duration::from_millis(20), c.now);
        assert!(!s.is_contended());
        // One that ran 3 ms over.
        let t0 = c.now;
        c.advance(Duration::from_millis(23));
        s.woke(t0, Duration::from_millis(20), c.now);
        assert!(s.is_contended());
    }

    #[test]
    fn contention_that_keeps_coming_back_lasts_longer() {
        let (mut s, mut c) = (Spinner::new(), Clock::new());
        // Short preemptions while contended (or right after) renew it; a quiet loop needs a
        // time slice lost.
        let short = |s: &mut Spinner, c: &mut Clock| late(s, c, Duration::from_millis(1));
        short(&mut s, &mut c);
        assert!(!s.is_contended());
        let late = |s: &mut Spinner, c: &mut Clock| late(s, c, SLICE);
        late(&mut s, &mut c);
        assert!(s.is_contended());
        assert_eq!(s.hold, CONTENDED_FOR);
        // Renewed while contended: same period.
        c.advance(CONTENDED_FOR / 2);
        short(&mut s, &mut c);
        assert_eq!(s.hold, CONTENDED_FOR);
        // Back right after it ended: doubled, up to the cap.
        let mut expect = CONTENDED_FOR;
        for _ in 0..10 {
            c.advance(s.hold + Duration::from_millis(1));
            short(&mut s, &mut c);
            expect = (expect * 2).min(MAX_CONTENDED_FOR);
            assert_eq!(s.hold, expect);
        }
        assert_eq!(s.hold, MAX_CONTENDED_FOR);
        // Back long after: a quiet loop again (a short preemption is not enough), the first
        // period again.
        c.advance(s.hold * 3);
        short(&mut s, &mut c);
        assert!(!s.is_contended());
        late(&mut s, &mut c);
        assert!(s.is_contended());
        assert_eq!(s.hold, CONTENDED_FOR);
    }
}
