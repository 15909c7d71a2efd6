//! The engine thread: owns the `LlmEngine`, takes commands from HTTP handlers, steps the model
//! while there is work, and routes each event to the request's channel. One HTTP request is a
//! group of engine sequences (its choices, `n` per prompt) that share one channel; when the
//! channel is closed (the client went away) every sequence of the group is aborted and its KV
//! blocks freed at the next step.

use std::collections::HashMap;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use nibble_engine::serving::{EngineStats, Event, LlmEngine, Request, RequestId};
use nibble_model::Backend;
use tokio::sync::{mpsc, oneshot};

use crate::metrics::Metrics;

pub enum Command {
    /// The sequences of one HTTP request: queued all together or not at all.
    Add {
        requests: Vec<(RequestId, Request)>,
        events: mpsc::UnboundedSender<Event>,
        accepted: oneshot::Sender<Result<(), nibble_core::Error>>,
    },
}

/// One HTTP request in the engine, named by its first sequence's id.
struct Group {
    events: mpsc::UnboundedSender<Event>,
    arrived: Instant,
    first_token: bool,
    /// Its sequences that have not finished.
    live: Vec<RequestId>,
}

/// One sequence: its group, and when it last produced a token.
struct Live {
    group: RequestId,
    last_token: Option<Instant>,
}

#[derive(Clone)]
pub struct EngineHandle {
    commands: std_mpsc::Sender<Command>,
    pub stats: Arc<Mutex<EngineStats>>,
    pub metrics: Arc<Metrics>,
    failure: Arc<Failure>,
}

/// Why the engine thread stopped for good, set once, and a wake-up for whoever waits on it.
#[derive(Default)]
struct Failure {
    reason: std::sync::OnceLock<String>,
    stopped: tokio::sync::Notify,
}

impl EngineHandle {
    pub fn spawn<B: Backend + 'static>(mut engine: LlmEngine<B>) -> EngineHandle
    where
        B::Kv: 'static,
    {
        let (tx, rx) = std_mpsc::channel::<Command>();
        let stats = Arc::new(Mutex::new(engine.stats()));
        let metrics = Arc::new(Metrics::default());
        let failure = Arc::new(Failure::default());
        let (stats2, metrics2, failure2) = (stats.clone(), metrics.clone(), failure.clone());
        std::thread::Builder::new()
            .name("nibble-engine".into())
            .spawn(move || {
                if let Err(reason) = run(&mut engine, rx, &stats2, &metrics2) {
                    eprintln!("nibble serve: {reason}");
                    let _ = failure2.reason.set(reason);
                    // A stored permit: the waiter may not be waiting yet.
                    failure2.stopped.notify_one();
                }
            })
            .expect("spawning the engine thread");
        EngineHandle {
            commands: tx,
            stats,
            metrics,
            failure,
        }
    }

    /// Why the engine stopped for good, if it did: a failed step of a tensor-parallel group.
    pub fn failure(&self) -> Option<String> {
        self.failure.reason.get().cloned()
    }

    /// Resolves when the engine has stopped for good ([`EngineHandle::failure`] says why): the
    /// server then shuts down rather than answer every request with an error.
    pub async fn stopped(&self) {
        if self.failure().is_none() {
            self.failure.stopped.notified().await;
        }
    }

    /// Queues the sequences of one request (all or none); the engine answers whether they were
    /// accepted. Their events arrive on one channel, told apart by id.
    pub async fn submit(
        &self,
        requests: Vec<(RequestId, Request)>,
    ) -> Result<mpsc::UnboundedReceiver<Event>, nibble_core::Error> {
        let (events, rx) = mpsc::unbounded_channel();
        let (accepted, answer) = oneshot::channel();
        self.commands
            .send(Command::Add {
                requests,
                events,
                accepted,
            })
            .map_err(|_| nibble_core::Error::InvalidArgument("the engine has stopped".into()))?;
        answer
            .await
            .map_err(|_| nibble_core::Error::InvalidArgument("the engine has stopped".into()))??;
        Ok(rx)
    }
}

/// The engine thread's loop, until the server drops its command channel; an error when a failed
/// step leaves the engine unable to go on (it leads a tensor-parallel group).
fn run<B: Backend>(
    engine: &mut LlmEngine<B>,
    rx: std_mpsc::Receiver<Command>,
    stats: &Mutex<EngineStats>,
    metrics: &Metrics,
) -> Result<(), String> {
    let mut groups: HashMap<RequestId, Group> = HashMap::new();
    let mut live: HashMap<RequestId, Live> = HashMap::new();
    // Aborts what is left of a group.
    let drop_group =
        |engine: &mut LlmEngine<B>, live: &mut HashMap<RequestId, Live>, group: Group| {
            for id in group.live {
                engine.abort(id);
                live.remove(&id);
            }
        };
    loop {
        // Block when idle; otherwise take whatever arrived since the last step.
        let first = if engine.has_work() {
            match rx.try_recv() {
                Ok(c) => Some(c),
                Err(std_mpsc::TryRecvError::Empty) => None,
                Err(std_mpsc::TryRecvError::Disconnected) => return Ok(()),
            }
        } else {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => return Ok(()),
            }
        };
        for cmd in first
            .into_iter()
            .chain(std::iter::from_fn(|| rx.try_recv().ok()))
        {
            let Command::Add {
                requests,
                events,
                accepted,
            } = cmd;
            let ids: Vec<RequestId> = requests.iter().map(|(id, _)| *id).collect();
            let Some(&name) = ids.first() else {
                let _ = accepted.send(Err(nibble_core::Error::InvalidArgument(
                    "a request without sequences".into(),
                )));
                continue;
            };
            match engine.add_requests(requests) {
                Ok(()) => {
                    for &id in &ids {
                        live.insert(
                            id,
                            Live {
                                group: name,
                                last_token: None,
                            },
                        );
                    }
                    groups.insert(
                        name,
                        Group {
                            events,
                            arrived: Instant::now(),
                            first_token: false,
                            live: ids,
                        },
                    );
                    let _ = accepted.send(Ok(()));
                }
                Err(e) => {
                    let _ = accepted.send(Err(e));
                }
            }
        }
        // Clients that disconnected: free their blocks before computing for them.
        let gone: Vec<RequestId> = groups
            .iter()
            .filter(|(_, g)| g.events.is_closed())
            .map(|(&name, _)| name)
            .collect();
        for name in gone {
            if let Some(g) = groups.remove(&name) {
                drop_group(engine, &mut live, g);
                metrics.cancelled.inc();
            }
        }
        if engine.has_work() {
            match engine.step() {
                Ok(events) => {
                    let now = Instant::now();
                    for ev in events {
                        let id = match &ev {
                            Event::Token { id, .. } | Event::Finished { id, .. } => *id,
                        };
                        let finished = matches!(ev, Event::Finished { .. });
                        let Some(l) = live.get_mut(&id) else { continue };
                        let name = l.group;
                        let Some(g) = groups.get_mut(&name) else {
                            continue;
                        };
                        if let Event::Token { .. } = ev {
                            if !g.first_token {
                                metrics.ttft.observe((now - g.arrived).as_secs_f64());
                                g.first_token = true;
                            }
                            if let Some(t) = l.last_token {
                                metrics.tpot.observe((now - t).as_secs_f64());
                            }
                            l.last_token = Some(now);
                        }
                        if g.events.send(ev).is_err() {
                            let g = groups.remove(&name).expect("found above");
                            drop_group(engine, &mut live, g);
                            metrics.cancelled.inc();
                            continue;
                        }
                        if finished {
                            live.remove(&id);
                            g.live.retain(|&s| s != id);
                            if g.live.is_empty() {
                                groups.remove(&name);
                                metrics.completed.inc();
                            }
                        }
                    }
                }
                Err(e) => {
                    // A failed step (e.g. out of memory) fails the requests in it, not the server;
                    // but as rank 0 of a tensor-parallel group the engine cannot go on (its
                    // ranks no longer hold the same sequences): the server ends with the error,
                    // and the group's abort frees the other ranks.
                    eprintln!("nibble serve: engine step failed: {e}");
                    for (_, g) in groups.drain() {
                        drop_group(engine, &mut live, g);
                        metrics.failed.inc();
                    }
                    if engine.leads_group() {
                        return Err(format!(
                            "a step failed on rank 0 of the tensor-parallel group, which cannot \
                             continue: {e}"
                        ));
                    }
                }
            }
        }
        if let Ok(mut s) = stats.lock() {
            *s = engine.stats();
        }
    }
}
