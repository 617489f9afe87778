//! What the kernel says about this process's memory (`/proc`, `/sys`): for diagnostics, and for
//! tests of what a process maps.

/// This process's resident memory of the mapping that contains `ptr`, in KiB: `Rss` in
/// `/proc/self/smaps`, which for a shared mapping counts the pages its page tables map (so it
/// shows which pages of the store this process has mapped, not what the store holds). `None` if
/// no mapping contains `ptr`.
pub fn resident_kib(ptr: *const u8) -> std::io::Result<Option<u64>> {
    let smaps = std::fs::read_to_string("/proc/self/smaps")?;
    let mut inside = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((lo, hi)) = first.split_once('-')
            && let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
        {
            inside = (lo..hi).contains(&(ptr as usize));
        } else if inside && let Some(kib) = line.strip_prefix("Rss:") {
            return Ok(kib.trim().trim_end_matches("kB").trim().parse().ok());
        }
    }
    Ok(None)
}

/// Which of the `pages` pages of `page` bytes from `base` have an entry in this process's page
/// tables (`/proc/self/pagemap`'s "present" bit, which any uid may read).
#[cfg(test)]
pub(crate) fn mapped_pages(base: *const u8, page: u64, pages: std::ops::Range<u64>) -> Vec<u64> {
    use std::os::unix::fs::FileExt;
    let pagemap = std::fs::File::open("/proc/self/pagemap").unwrap();
    pages
        .filter(|p| {
            let mut entry = [0u8; 8];
            let at = (base as u64 + p * page) / page * 8;
            pagemap.read_exact_at(&mut entry, at).unwrap();
            u64::from_le_bytes(entry) >> 63 == 1
        })
        .collect()
}

/// The kernel's transparent-huge-page mode for shared memory (`never`, `advise`, `always`,
/// `within_size`, `deny`, `force`), from `/sys/kernel/mm/transparent_hugepage/shmem_enabled`;
/// `None` where the kernel has none.
pub fn shmem_thp_mode() -> Option<&'static str> {
    let modes =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").ok()?;
    let active = modes.split_whitespace().find(|w| w.starts_with('['))?;
    ["never", "advise", "always", "within_size", "deny", "force"]
        .into_iter()
        .find(|m| active.trim_matches(['[', ']']) == *m)
}
