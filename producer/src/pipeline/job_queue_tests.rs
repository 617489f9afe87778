use super::*;

struct At(u64, &'static str);

impl Ordered for At {
    fn order(&self) -> u64 {
        self.0
    }
}

#[test]
fn the_lowest_order_goes_first_and_equals_in_arrival_order() {
    let (tx, queue) = JobQueue::new();
    let _worker = queue.worker();
    for job in [At(5, "e"), At(1, "a1"), At(3, "c"), At(1, "a2"), At(2, "b")] {
        tx.send(job, None);
    }
    drop(tx);
    let profiler = Profiler::default();
    let order: Vec<_> = std::iter::from_fn(|| queue.next(&profiler).map(|a| a.1)).collect();
    assert_eq!(order, ["a1", "a2", "b", "c", "e"]);
}

#[test]
fn idle_runs_once_before_a_wait_and_never_while_jobs_are_ready() {
    let (tx, queue) = JobQueue::new();
    let _worker = queue.worker();
    let profiler = Profiler::default();
    tx.send(At(1, "ready"), None);
    let job = queue.next_or_idle(&profiler, || panic!("a job was ready"));
    assert_eq!(job.unwrap().1, "ready");
    // None ready: idle runs (here it queues a job, as a late fetch would), then the wait
    // finds the job.
    let mut idled = 0;
    let job = queue.next_or_idle(&profiler, || {
        idled += 1;
        tx.send(At(2, "late"), None);
    });
    assert_eq!((job.unwrap().1, idled), ("late", 1));
    drop(tx);
    let mut idled = 0;
    assert!(queue.next_or_idle(&profiler, || idled += 1).is_none());
    assert_eq!(idled, 0, "a closed queue has nothing to wait for");
}

#[test]
fn a_permit_comes_back_when_its_job_is_taken_or_no_worker_is_left() {
    let permits = Arc::new(tokio::sync::Semaphore::new(2));
    let (tx, queue) = JobQueue::new();
    let worker = queue.worker();
    let profiler = Profiler::default();
    tx.send(
        At(1, "a"),
        Some(permits.clone().try_acquire_owned().unwrap()),
    );
    tx.send(
        At(2, "b"),
        Some(permits.clone().try_acquire_owned().unwrap()),
    );
    assert_eq!(permits.available_permits(), 0);
    assert_eq!(queue.next(&profiler).unwrap().1, "a");
    assert_eq!(permits.available_permits(), 1);
    // The last worker ends: what waits is dropped, and what comes later too.
    drop(worker);
    assert_eq!(permits.available_permits(), 2);
    tx.send(
        At(3, "c"),
        Some(permits.clone().try_acquire_owned().unwrap()),
    );
    assert_eq!(permits.available_permits(), 2);
}

#[test]
fn a_worker_waits_until_a_job_comes_or_the_last_sender_goes() {
    let (tx, queue) = JobQueue::<At>::new();
    let _worker = queue.worker();
    let waiting = {
        let queue = queue.clone();
        std::thread::spawn(move || {
            let profiler = Profiler::default();
            let first = queue.next(&profiler).map(|a| a.1);
            let second = queue.next(&profiler).map(|a| a.1);
            (first, second)
        })
    };
    let other = tx.clone();
    other.send(At(1, "a"), None);
    drop(other);
    drop(tx);
    assert_eq!(waiting.join().unwrap(), (Some("a"), None));
}
