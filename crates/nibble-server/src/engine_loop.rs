//! The engine thread: owns the `LlmEngine`, takes commands from HTTP handlers, steps the model
//! while there is work, and routes each event to the request's channel. A request whose channel
//! is closed (the client went away) is aborted and its KV blocks freed at the next step.

use std::collections::HashMap;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use nibble_engine::serving::{EngineStats, Event, LlmEngine, Request, RequestId};
use nibble_model::Backend;
use tokio::sync::{mpsc, oneshot};

use crate::metrics::Metrics;

pub enum Command {
    Add {
        id: RequestId,
        request: Request,
        events: mpsc::UnboundedSender<Event>,
        accepted: oneshot::Sender<Result<(), nibble_core::Error>>,
    },
}

struct Live {
    events: mpsc::UnboundedSender<Event>,
    arrived: Instant,
    last_token: Option<Instant>,
}

#[derive(Clone)]
pub struct EngineHandle {
    commands: std_mpsc::Sender<Command>,
    pub stats: Arc<Mutex<EngineStats>>,
    pub metrics: Arc<Metrics>,
}

impl EngineHandle {
    pub fn spawn<B: Backend + 'static>(mut engine: LlmEngine<B>) -> EngineHandle
    where
        B::Kv: 'static,
    {
        let (tx, rx) = std_mpsc::channel::<Command>();
        let stats = Arc::new(Mutex::new(engine.stats()));
        let metrics = Arc::new(Metrics::default());
        let (stats2, metrics2) = (stats.clone(), metrics.clone());
        std::thread::Builder::new()
            .name("nibble-engine".into())
            .spawn(move || run(&mut engine, rx, &stats2, &metrics2))
            .expect("spawning the engine thread");
        EngineHandle {
            commands: tx,
            stats,
            metrics,
        }
    }

    /// Queues a request; the engine answers whether it was accepted.
    pub async fn submit(
        &self,
        id: RequestId,
        request: Request,
    ) -> Result<mpsc::UnboundedReceiver<Event>, nibble_core::Error> {
        let (events, rx) = mpsc::unbounded_channel();
        let (accepted, answer) = oneshot::channel();
        self.commands
            .send(Command::Add {
                id,
                request,
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

fn run<B: Backend>(
    engine: &mut LlmEngine<B>,
    rx: std_mpsc::Receiver<Command>,
    stats: &Mutex<EngineStats>,
    metrics: &Metrics,
) {
    let mut live: HashMap<RequestId, Live> = HashMap::new();
    loop {
        // Block when idle; otherwise take whatever arrived since the last step.
        let first = if engine.has_work() {
            match rx.try_recv() {
                Ok(c) => Some(c),
                Err(std_mpsc::TryRecvError::Empty) => None,
                Err(std_mpsc::TryRecvError::Disconnected) => return,
            }
        } else {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => return,
            }
        };
        for cmd in first
            .into_iter()
            .chain(std::iter::from_fn(|| rx.try_recv().ok()))
        {
            let Command::Add {
                id,
                request,
                events,
                accepted,
            } = cmd;
            match engine.add_request(id, request) {
                Ok(()) => {
                    live.insert(
                        id,
                        Live {
                            events,
                            arrived: Instant::now(),
                            last_token: None,
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
        let gone: Vec<RequestId> = live
            .iter()
            .filter(|(_, l)| l.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            engine.abort(id);
            live.remove(&id);
            metrics.cancelled.inc();
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
                        if let Event::Token { .. } = ev {
                            match l.last_token {
                                None => metrics.ttft.observe((now - l.arrived).as_secs_f64()),
                                Some(t) => metrics.tpot.observe((now - t).as_secs_f64()),
                            }
                            l.last_token = Some(now);
                        }
                        if l.events.send(ev).is_err() {
                            engine.abort(id);
                            live.remove(&id);
                            metrics.cancelled.inc();
                            continue;
                        }
                        if finished {
                            live.remove(&id);
                            metrics.completed.inc();
                        }
                    }
                }
                Err(e) => {
                    // A failed step (e.g. out of memory) fails the requests in it, not the server.
                    eprintln!("nibble serve: engine step failed: {e}");
                    for (id, _) in live.drain() {
                        engine.abort(id);
                        metrics.failed.inc();
                    }
                }
            }
        }
        if let Ok(mut s) = stats.lock() {
            *s = engine.stats();
        }
    }
}
