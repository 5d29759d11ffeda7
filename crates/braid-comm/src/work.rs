//! Asynchronous operations: a progress thread per communicator that runs
//! queued operations in order, [`Work`] handles, and [`Scope`], which ties
//! borrowed buffers to the operations using them.
//!
//! `Communicator::scope` works like `std::thread::scope`: operations started
//! inside it may borrow buffers from outside, and the scope does not return
//! until every one of them has finished (even if the closure panics or a
//! handle is forgotten), which is what makes the borrows sound.

use crate::api::Call;
use crate::communicator::Communicator;
use crate::error::{CommError, Result};
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

type Job = Box<dyn FnOnce() + Send + 'static>;

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    running: bool,
    started: bool,
    shutdown: bool,
}

/// The per-communicator queue of asynchronous operations.
#[derive(Default)]
pub(crate) struct Progress {
    shared: Arc<(Mutex<Queue>, Condvar)>,
}

impl Progress {
    fn enqueue(&self, job: Job) {
        let (lock, cv) = &*self.shared;
        let mut q = lock.lock().unwrap_or_else(|p| p.into_inner());
        q.jobs.push_back(job);
        if !q.started {
            q.started = true;
            let shared = self.shared.clone();
            std::thread::Builder::new()
                .name("braid-comm-progress".into())
                .spawn(move || progress_loop(shared))
                .expect("spawning the communicator's progress thread");
        }
        cv.notify_all();
    }

    /// Blocks until no queued or running operation remains.
    pub(crate) fn wait_idle(&self) {
        let (lock, cv) = &*self.shared;
        let mut q = lock.lock().unwrap_or_else(|p| p.into_inner());
        while !q.jobs.is_empty() || q.running {
            q = cv.wait(q).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        let (lock, cv) = &*self.shared;
        lock.lock().unwrap_or_else(|p| p.into_inner()).shutdown = true;
        cv.notify_all();
    }
}

fn progress_loop(shared: Arc<(Mutex<Queue>, Condvar)>) {
    let (lock, cv) = &*shared;
    loop {
        let job = {
            let mut q = lock.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                if let Some(job) = q.jobs.pop_front() {
                    q.running = true;
                    break job;
                }
                if q.shutdown {
                    return;
                }
                q = cv.wait(q).unwrap_or_else(|p| p.into_inner());
            }
        };
        job();
        let mut q = lock.lock().unwrap_or_else(|p| p.into_inner());
        q.running = false;
        cv.notify_all();
    }
}

#[derive(Default)]
struct WorkState {
    result: Mutex<Option<Result<()>>>,
    done: Condvar,
}

impl WorkState {
    fn complete(&self, r: Result<()>) {
        *self.result.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
        self.done.notify_all();
    }
}

/// Handle of an asynchronous operation.
#[must_use = "an operation's result is only known by waiting on its Work"]
pub struct Work<'scope> {
    state: Arc<WorkState>,
    _scope: PhantomData<&'scope ()>,
}

impl Work<'_> {
    /// Blocks until the operation finishes and returns its result.
    pub fn wait(self) -> Result<()> {
        let mut r = self.state.result.lock().unwrap_or_else(|p| p.into_inner());
        while r.is_none() {
            r = self.state.done.wait(r).unwrap_or_else(|p| p.into_inner());
        }
        r.clone().expect("checked above")
    }

    /// Waits at most `timeout`: `Ok(true)` if it finished successfully,
    /// `Ok(false)` if still running, the error if it failed.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<bool> {
        let deadline = Instant::now() + timeout;
        let mut r = self.state.result.lock().unwrap_or_else(|p| p.into_inner());
        while r.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            r = self
                .state
                .done
                .wait_timeout(r, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        r.clone().expect("checked above").map(|_| true)
    }

    /// Whether the operation has finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        self.state
            .result
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }
}

/// Asynchronous operations whose buffers are borrowed for `'scope`.
pub struct Scope<'scope, 'env: 'scope> {
    pub(crate) comm: &'env Communicator,
    works: Mutex<Vec<Arc<WorkState>>>,
    _scope: PhantomData<&'scope mut &'scope ()>,
    _env: PhantomData<&'env mut &'env ()>,
}

impl<'scope, 'env> Scope<'scope, 'env> {
    /// Queues `call` on the progress thread.
    pub(crate) fn submit(&'scope self, call: Call<'scope>) -> Work<'scope> {
        let state = Arc::new(WorkState::default());
        self.works
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(state.clone());
        let comm = self.comm.clone();
        let Call { desc, run } = call;
        // SAFETY: `run` borrows buffers for 'scope. `Communicator::scope`
        // does not return before every submitted job has completed (the
        // guard in it waits even on panic), so the borrows outlive the job
        // although its type claims 'static.
        let run: crate::api::RunFn<'static> = unsafe { std::mem::transmute(run) };
        let done = state.clone();
        let record = self.comm.record_queued(&desc);
        self.comm.inner.progress.enqueue(Box::new(move || {
            let r = comm.execute_queued(desc, Some(record), run);
            // The job's handle goes before the waiter hears: otherwise the
            // waiter's may be dropped first, the communicator would end
            // here, or not at all if the process exits meanwhile (and its
            // rank's clean departure would go unannounced).
            drop(comm);
            done.complete(r);
        }));
        Work {
            state,
            _scope: PhantomData,
        }
    }

    /// Fails a submission that could not even be validated.
    pub(crate) fn failed(&'scope self, e: CommError) -> Work<'scope> {
        let state = Arc::new(WorkState::default());
        state.complete(Err(e));
        Work {
            state,
            _scope: PhantomData,
        }
    }

    fn wait_all(&self) -> Result<()> {
        let works = std::mem::take(&mut *self.works.lock().unwrap_or_else(|p| p.into_inner()));
        let mut first = Ok(());
        for w in works {
            let r = Work {
                state: w,
                _scope: PhantomData,
            }
            .wait();
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

/// Waits for the scope's operations when dropped (also during unwinding).
struct WaitGuard<'a, 'scope, 'env>(&'a Scope<'scope, 'env>);

impl Drop for WaitGuard<'_, '_, '_> {
    fn drop(&mut self) {
        let _ = self.0.wait_all();
    }
}

impl Communicator {
    /// Runs `f` with a [`Scope`] in which operations are started
    /// asynchronously on borrowed buffers and return [`Work`] handles.
    /// Operations complete in the order they are issued. Returns `f`'s
    /// value once every operation has finished, or the first error among
    /// the scope's operations.
    ///
    /// ```no_run
    /// # use braid_comm::{Communicator, ReduceOp};
    /// # fn f(comm: &Communicator) -> braid_comm::Result<()> {
    /// let mut grads = vec![1.0f32; 1 << 20];
    /// let mut other = vec![0.0f32; 1024];
    /// comm.scope(|s| {
    ///     let w = s.all_reduce(&mut grads, ReduceOp::Avg);
    ///     // ... compute while it runs ...
    ///     s.broadcast(&mut other, 0);
    ///     w.wait()
    /// })??;
    /// # Ok(()) }
    /// ```
    pub fn scope<'env, F, T>(&'env self, f: F) -> Result<T>
    where
        F: for<'scope> FnOnce(&'scope Scope<'scope, 'env>) -> T,
    {
        let scope = Scope {
            comm: self,
            works: Mutex::new(Vec::new()),
            _scope: PhantomData,
            _env: PhantomData,
        };
        // If `f` panics, the guard still waits for every operation before
        // the borrowed buffers can be touched again.
        let guard = WaitGuard(&scope);
        let value = f(&scope);
        let result = scope.wait_all();
        std::mem::forget(guard);
        result.map(|_| value)
    }
}
