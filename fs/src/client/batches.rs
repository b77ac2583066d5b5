//! A queue of messages to the meta-server that go in batches, one batch at
//! a time, sent by one thread of the client: the releases after closes
//! ([`super::releases`]) and the unlinks answered before they are sent
//! ([`super::late_changes`]). Each module says what its messages may wait
//! for; this one only decides when a batch goes:
//!
//! * at once when `max` items are waiting;
//! * at once after [`Batches::send_now`];
//! * else `linger` after the oldest item was queued;
//!
//! and never while another batch is on its way ([`Batches::sent`] ends
//! it), so a [`Batches::flush`] that returns leaves nothing queued before
//! it unsent or unanswered.

use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

struct Queue<T> {
    waiting: Vec<T>,
    /// When the oldest waiting item was queued.
    since: Option<Instant>,
    /// A batch is on its way to the meta-server: a flush waits for it, so
    /// that what it flushes is there before the flusher's next request.
    in_flight: bool,
    /// The waiting items go as soon as no batch is in flight.
    now: bool,
    stop: bool,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Self { waiting: Vec::new(), since: None, in_flight: false, now: false, stop: false }
    }
}

/// The queue and the condition its sender waits on.
pub(super) struct Batches<T> {
    queue: Mutex<Queue<T>>,
    changed: Condvar,
    /// How long the oldest queued item waits for others.
    linger: Duration,
    /// Items that go at once, without waiting out the linger.
    max: usize,
}

impl<T> Batches<T> {
    pub(super) fn new(linger: Duration, max: usize) -> Self {
        Self { queue: Mutex::default(), changed: Condvar::new(), linger, max }
    }

    pub(super) fn push(&self, item: T) {
        let mut q = self.queue.lock();
        q.waiting.push(item);
        if q.since.is_none() {
            q.since = Some(Instant::now());
            self.changed.notify_all();
        } else if q.waiting.len() == self.max {
            self.changed.notify_all();
        }
    }

    /// The next batch for the sender thread, once it is due; `None` once
    /// the queue stops.
    pub(super) fn next_batch(&self) -> Option<Vec<T>> {
        let mut q = self.queue.lock();
        loop {
            if q.stop {
                return None;
            }
            match q.since {
                Some(since) if !q.in_flight => {
                    let due = since + self.linger;
                    if q.now || q.waiting.len() >= self.max || Instant::now() >= due {
                        return Some(Self::take(&mut q));
                    }
                    self.changed.wait_until(&mut q, due);
                }
                _ => self.changed.wait(&mut q),
            }
        }
    }

    /// The sender thread's loop: sends each batch with `send` as it falls
    /// due, until the queue stops. `send` returns once the batch is
    /// answered, with how long to wait before the next one (a batch it
    /// could not send and put back, [`Self::requeue`]) or `None`.
    pub(super) fn serve(&self, mut send: impl FnMut(Vec<T>) -> Option<Duration>) {
        while let Some(batch) = self.next_batch() {
            let nap = send(batch);
            self.sent();
            if let Some(nap) = nap {
                std::thread::sleep(nap);
            }
        }
    }

    /// Has what is queued sent as soon as no batch is in flight.
    pub(super) fn send_now(&self) {
        let mut q = self.queue.lock();
        if !q.waiting.is_empty() && !q.now {
            q.now = true;
            self.changed.notify_all();
        }
    }

    /// Changes, with `f`, the items still waiting (not those of a batch on
    /// its way).
    pub(super) fn amend_waiting(&self, f: impl FnMut(&mut T)) {
        self.queue.lock().waiting.iter_mut().for_each(f);
    }

    fn take(q: &mut Queue<T>) -> Vec<T> {
        q.since = None;
        q.now = false;
        q.in_flight = true;
        std::mem::take(&mut q.waiting)
    }

    /// Puts `items`, a batch that could not be sent, back in front of
    /// what was queued since, to go as soon as it can (before the batch
    /// that took them is marked [`Self::sent`]).
    pub(super) fn requeue(&self, mut items: Vec<T>) {
        if items.is_empty() {
            return;
        }
        let mut q = self.queue.lock();
        items.append(&mut q.waiting);
        q.waiting = items;
        q.since.get_or_insert_with(Instant::now);
        q.now = true;
        self.changed.notify_all();
    }

    /// The batch [`Self::next_batch`] or [`Self::flush`] took is answered.
    pub(super) fn sent(&self) {
        self.queue.lock().in_flight = false;
        self.changed.notify_all();
    }

    /// Waits for a batch on its way, then sends what is queued with
    /// `send` (which returns once it is answered); whether there was
    /// anything to wait for or send.
    pub(super) fn flush(&self, send: impl FnOnce(Vec<T>)) -> bool {
        let batch = {
            let mut q = self.queue.lock();
            let mut waited = false;
            while q.in_flight {
                self.changed.wait(&mut q);
                waited = true;
            }
            if q.waiting.is_empty() {
                return waited;
            }
            Self::take(&mut q)
        };
        send(batch);
        self.sent();
        true
    }

    pub(super) fn stop(&self) {
        self.queue.lock().stop = true;
        self.changed.notify_all();
    }

    /// Items queued and not yet sent.
    pub(super) fn len(&self) -> usize {
        self.queue.lock().waiting.len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    const SHORT: Duration = Duration::from_millis(5);

    /// A sender waiting for `b`'s next batch: its size, once it goes.
    /// Checked not to have gone after a while of waiting.
    fn waiting_sender(b: &Arc<Batches<u64>>, why: &str) -> std::thread::JoinHandle<Option<usize>> {
        let sender = {
            let b = b.clone();
            std::thread::spawn(move || b.next_batch().map(|b| b.len()))
        };
        std::thread::sleep(SHORT * 5);
        assert!(!sender.is_finished(), "{why}");
        sender
    }

    /// Items queued within the linger of the first go as one batch; a
    /// batch in flight keeps the sender from starting the next one until
    /// it is sent.
    #[test]
    fn items_queued_together_go_together_and_one_batch_at_a_time() {
        let b = Batches::new(SHORT, 128);
        for item in 1..=3 {
            b.push(item);
        }
        assert_eq!(b.next_batch(), Some(vec![1, 2, 3]));
        // The batch is in flight: an item queued now waits for it.
        b.push(4);
        let b = Arc::new(b);
        let sender = waiting_sender(&b, "a second batch went while the first was in flight");
        b.sent();
        assert_eq!(sender.join().unwrap(), Some(1));
        b.sent();
        b.stop();
        assert!(b.next_batch().is_none(), "a stopped queue gives no batch");
    }

    /// What is queued goes without waiting out the linger once it is
    /// asked to, and only then.
    #[test]
    fn send_now_ends_the_linger() {
        let b = Arc::new(Batches::new(Duration::from_secs(3600), 128));
        b.send_now(); // nothing queued: nothing to remember
        b.push(1);
        b.push(2);
        let sender = waiting_sender(&b, "a batch went before the linger or a send_now");
        b.send_now();
        assert_eq!(sender.join().unwrap(), Some(2));
        b.sent();
        b.stop();
    }

    /// A full batch goes without waiting out the linger.
    #[test]
    fn a_full_batch_goes_at_once() {
        let b = Batches::new(Duration::from_secs(3600), 16);
        (0..16).for_each(|item| b.push(item));
        assert_eq!(b.next_batch().unwrap().len(), 16);
    }

    /// A flush waits for the batch on its way and sends what was queued
    /// behind it itself, so nothing queued before it is left unanswered.
    #[test]
    fn a_flush_waits_for_the_batch_in_flight_and_sends_the_rest() {
        let b = Arc::new(Batches::new(Duration::from_secs(3600), 128));
        b.push(1);
        b.send_now();
        assert_eq!(b.next_batch(), Some(vec![1]));
        b.push(2);
        let flusher = {
            let b = b.clone();
            std::thread::spawn(move || {
                let mut sent = Vec::new();
                let any = b.flush(|batch| sent = batch);
                (any, sent)
            })
        };
        std::thread::sleep(SHORT * 5);
        assert!(!flusher.is_finished(), "a flush returned while a batch was in flight");
        b.sent();
        assert_eq!(flusher.join().unwrap(), (true, vec![2]));
        assert_eq!(b.len(), 0);
        assert!(!b.flush(|_| panic!("nothing was queued")), "an empty flush reported work");
    }

    /// A batch that could not be sent goes back in front of what was
    /// queued since, and goes without waiting out the linger.
    #[test]
    fn a_batch_put_back_goes_first_and_at_once() {
        let b = Batches::new(Duration::from_secs(3600), 128);
        b.push(1);
        b.send_now();
        let batch = b.next_batch().unwrap();
        b.push(2);
        b.requeue(batch);
        b.sent();
        assert_eq!(b.next_batch(), Some(vec![1, 2]));
    }
}
