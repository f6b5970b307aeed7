//! What the machine has: memory, as Linux reports it in /proc/meminfo (None elsewhere or when unreadable).

/// Total physical memory (`MemTotal`).
pub fn physical_memory_bytes() -> Option<u64> {
    meminfo("MemTotal:")
}

/// Memory available to a new allocation without swapping (`MemAvailable`).
pub fn available_memory_bytes() -> Option<u64> {
    meminfo("MemAvailable:")
}

fn meminfo(key: &str) -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    #[test]
    fn memory_figures_are_plausible_where_linux_reports_them() {
        if let (Some(total), Some(avail)) = (super::physical_memory_bytes(), super::available_memory_bytes()) {
            assert!(total >= avail && total > 1 << 30, "{total} {avail}");
        }
    }
}
