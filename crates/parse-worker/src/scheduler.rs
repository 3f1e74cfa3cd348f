//! A scheduler task: one thread owns a state (an engine and what goes with it) and runs the commands it receives
//! over a bounded channel, one at a time, in arrival order, answering each over a `oneshot`. It replaces a lock: async
//! handlers never block on the engine, and nothing else can reach it.
//!
//! A command whose caller has gone (its reply receiver dropped: a cancelled request) is skipped. The thread ends
//! when every handle is dropped or the cancellation token fires; later calls answer [`SchedulerError::Stopped`].

use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

type Command<S> = Box<dyn FnOnce(&mut S) + Send>;

/// Why a command did not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchedulerError {
    /// The queue is full.
    Full,
    /// The scheduler has stopped (shutdown).
    Stopped,
}

/// A handle to a scheduler task. Cheap to clone.
pub struct Scheduler<S> {
    tx: mpsc::Sender<Command<S>>,
}

impl<S> Clone for Scheduler<S> {
    fn clone(&self) -> Self {
        Scheduler {
            tx: self.tx.clone(),
        }
    }
}

impl<S: Send + 'static> Scheduler<S> {
    /// Starts the task on a thread of its own (engine work blocks), holding at most `queue` waiting commands.
    pub fn spawn(name: &str, mut state: S, queue: usize, cancel: CancellationToken) -> Self {
        let (tx, mut rx) = mpsc::channel::<Command<S>>(queue);
        let thread = format!("{name} scheduler");
        let spawned = std::thread::Builder::new().name(thread).spawn(move || {
            while let Some(cmd) = rx.blocking_recv() {
                if cancel.is_cancelled() {
                    break;
                }
                cmd(&mut state);
            }
            rx.close();
        });
        if let Err(e) = spawned {
            // Without its thread the scheduler answers Stopped to every call.
            tracing::error!("{name}: cannot start the scheduler thread: {e}");
        }
        Scheduler { tx }
    }

    fn command<T: Send + 'static>(
        f: impl FnOnce(&mut S) -> T + Send + 'static,
    ) -> (Command<S>, oneshot::Receiver<T>) {
        let (reply, rx) = oneshot::channel();
        let cmd: Command<S> = Box::new(move |s: &mut S| {
            // The caller is gone: skip the work.
            if reply.is_closed() {
                return;
            }
            let _ = reply.send(f(s));
        });
        (cmd, rx)
    }

    /// Runs `f` on the state, waiting for room in the queue.
    pub async fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut S) -> T + Send + 'static,
    ) -> Result<T, SchedulerError> {
        let (cmd, rx) = Self::command(f);
        self.tx
            .send(cmd)
            .await
            .map_err(|_| SchedulerError::Stopped)?;
        rx.await.map_err(|_| SchedulerError::Stopped)
    }

    /// Runs `f` on the state, or fails at once with [`SchedulerError::Full`] when the queue is full.
    pub async fn try_call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut S) -> T + Send + 'static,
    ) -> Result<T, SchedulerError> {
        let (cmd, rx) = Self::command(f);
        self.tx.try_send(cmd).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => SchedulerError::Full,
            mpsc::error::TrySendError::Closed(_) => SchedulerError::Stopped,
        })?;
        rx.await.map_err(|_| SchedulerError::Stopped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn commands_run_in_order_a_full_queue_refuses_and_cancel_stops() {
        let cancel = CancellationToken::new();
        let s = Scheduler::spawn("test", Vec::<u32>::new(), 1, cancel.clone());
        for i in 0..5 {
            s.call(move |v| v.push(i)).await.unwrap();
        }
        assert_eq!(s.call(|v| v.clone()).await.unwrap(), [0, 1, 2, 3, 4]);
        // One slow command running, one queued: the next is refused.
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let slow = {
            let s = s.clone();
            tokio::spawn(async move { s.call(move |_| wait.recv().is_ok()).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let queued = {
            let s = s.clone();
            tokio::spawn(async move { s.call(|v| v.len()).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(s.try_call(|v| v.len()).await, Err(SchedulerError::Full));
        go.send(()).unwrap();
        assert_eq!(slow.await.unwrap(), Ok(true));
        assert_eq!(queued.await.unwrap(), Ok(5));
        cancel.cancel();
        // The thread sees the token at its next command and stops.
        let _ = s.call(|v| v.len()).await;
        assert_eq!(s.call(|v| v.len()).await, Err(SchedulerError::Stopped));
    }

    #[tokio::test]
    async fn a_command_whose_caller_left_is_skipped() {
        let s = Scheduler::spawn("test", 0u32, 4, CancellationToken::new());
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let blocker = {
            let s = s.clone();
            tokio::spawn(async move { s.call(move |_| wait.recv().is_ok()).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let abandoned = {
            let s = s.clone();
            tokio::spawn(async move { s.call(|n| *n += 1).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        abandoned.abort();
        let _ = abandoned.await;
        go.send(()).unwrap();
        blocker.await.unwrap().unwrap();
        assert_eq!(
            s.call(|n| *n).await.unwrap(),
            0,
            "the abandoned command ran"
        );
    }
}
