//! The in-process serving plane: the shards of this process behind a [`Dispatcher`], with
//! worker selection by the router mode.

use std::sync::atomic::{AtomicUsize, Ordering};

use kvx_ingress::{DispatchError, Dispatcher, WorkerState};
use kvx_proto::{GenerateRequest, Output, RequestId, WorkerMetrics};
use kvx_worker::{ShardHandle, SubmitError};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

/// Local shards as one dispatcher.
#[derive(Debug)]
pub(crate) struct LocalPlane {
    shards: Vec<ShardHandle>,
    next: AtomicUsize,
}

impl LocalPlane {
    pub(crate) fn new(shards: Vec<ShardHandle>) -> Self {
        LocalPlane { shards, next: AtomicUsize::new(0) }
    }

    /// Stops every shard, giving running requests `grace` to finish.
    #[allow(dead_code)]
    pub(crate) fn shutdown(self, grace: std::time::Duration) {
        for s in self.shards {
            s.shutdown(grace);
        }
    }

    /// Shards in preference order for a new request: least loaded first (running plus
    /// queued requests), ties broken round-robin.
    fn order(&self) -> Vec<usize> {
        let n = self.shards.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n.max(1);
        let mut idx: Vec<(u64, usize)> = (0..n)
            .map(|k| {
                let i = (start + k) % n;
                let st = self.shards[i].status();
                (st.requests as u64 * 1000 + u64::from(st.load.active_blocks), i)
            })
            .collect();
        idx.sort_by_key(|&(load, _)| load);
        idx.into_iter().map(|(_, i)| i).collect()
    }
}

impl Dispatcher for LocalPlane {
    fn submit(&self, req: GenerateRequest) -> Result<UnboundedReceiver<Output>, DispatchError> {
        let mut req = Some(req);
        let mut any_alive = false;
        for i in self.order() {
            let shard = &self.shards[i];
            if !shard.is_alive() {
                continue;
            }
            any_alive = true;
            let (tx, rx) = unbounded_channel();
            let Some(r) = req.take() else { break };
            match shard.submit(r.clone(), tx) {
                Ok(()) => return Ok(rx),
                Err(SubmitError::Full | SubmitError::Closed) => req = Some(r),
            }
        }
        if any_alive {
            Err(DispatchError::Overloaded("every worker's queue is full".into()))
        } else {
            Err(DispatchError::Unavailable("no worker is running".into()))
        }
    }

    fn cancel(&self, id: RequestId) {
        for s in &self.shards {
            s.cancel(id);
        }
    }

    fn ready(&self) -> bool {
        self.shards.iter().any(ShardHandle::is_alive)
    }

    fn workers(&self) -> Vec<WorkerState> {
        self.shards
            .iter()
            .map(|s| {
                let st = s.status();
                WorkerState {
                    id: st.load.worker_id,
                    alive: s.is_alive(),
                    metrics: WorkerMetrics {
                        load: st.load,
                        prompt_tokens: st.stats.prompt_tokens,
                        cached_tokens: st.stats.cached_tokens,
                        prefill_tokens: st.stats.prefill_tokens,
                        generated_tokens: st.stats.generated_tokens,
                        preemptions: st.stats.preemptions,
                        finished: st.stats.finished,
                        steps: st.stats.steps,
                    },
                }
            })
            .collect()
    }
}
