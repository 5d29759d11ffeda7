//! The process cache reads a file four times larger than its bound in
//! FFCV's quasi-random order: every page read exactly once in the epoch,
//! every value right, and the process's resident memory grows by less
//! than the bound (plus a little for the test itself). Alone in its own
//! test binary, so nothing else moves the resident-set figure.

use braid_data::beton::{FieldType, FieldValue, Value, Writer};
use braid_data::cache::PageCache;
use braid_data::order::{EpochPlan, Order};

fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

fn payload(s: usize) -> Vec<u8> {
    (0..5000 + s % 2000).map(|i| (s * 31 + i) as u8).collect()
}

#[test]
fn quasi_random_reads_each_page_once_within_the_bound() {
    let page = 64 << 10;
    let n = 10_000;
    let path = std::env::temp_dir().join(format!("braid-pcache-{}.beton", std::process::id()));
    let fields = vec![
        ("id".to_string(), FieldType::Int),
        ("data".to_string(), FieldType::Bytes),
    ];
    let mut w = Writer::create(&path, &fields, n as u64, page).unwrap();
    for s in 0..n {
        w.push(&[FieldValue::Int(s as i64), FieldValue::Bytes(payload(s))])
            .unwrap();
    }
    let written = w.finish().unwrap();
    let capacity = (written.bytes / page / 4) as usize; // a quarter of the file
    let mut cache = PageCache::open(&path, capacity).unwrap();
    assert!(written.bytes >= 4 * cache.bound_bytes());
    let pages: Vec<u64> = (0..n)
        .map(|s| cache.index().pages_of(s).next().unwrap())
        .collect();
    let distinct: std::collections::BTreeSet<u64> = pages.iter().copied().collect();
    let plan = EpochPlan::new(Order::QuasiRandom, n, pages, 64, 0, 1, 7, false)
        .unwrap()
        .with_window(capacity / 2);
    let order: Vec<usize> = plan.batches(0).concat();
    assert_eq!(order.len(), n);

    let before = resident_bytes();
    let mut peak_growth = 0u64;
    cache.start_epoch(&order);
    for (k, &s) in order.iter().enumerate() {
        let ok = cache
            .with_sample(s, |v| {
                v[0] == Value::Int(s as i64) && v[1] == Value::Bytes(&payload(s))
            })
            .unwrap();
        assert!(ok, "sample {s} read wrong");
        if k % 256 == 0 {
            peak_growth = peak_growth.max(resident_bytes().saturating_sub(before));
        }
    }
    std::fs::remove_file(&path).unwrap();
    assert_eq!(cache.loads(), distinct.len() as u64, "each page read once");
    assert!(cache.peak_pages() <= capacity);
    let slack = 4 << 20;
    assert!(
        peak_growth <= cache.bound_bytes() + slack,
        "resident memory grew by {peak_growth} bytes; bound {} + {slack}",
        cache.bound_bytes()
    );
    println!(
        "file {} bytes, bound {} bytes, resident growth {} bytes, {} pages read once",
        written.bytes,
        cache.bound_bytes(),
        peak_growth,
        cache.loads()
    );
}
