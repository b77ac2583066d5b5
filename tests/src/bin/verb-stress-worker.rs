//! Worker process of the verbs linearizability stress test.
//!
//! `verb-stress-worker FABRIC THREADS ITERATIONS` (see `--help`) joins
//! FABRIC, and each of THREADS threads performs ITERATIONS rounds of: a
//! fetch-and-add, a masked fetch-and-add on two fields (+1 and −1), a
//! CAS-loop increment and a 16-byte extended fetch-and-add, all on words of
//! region 1 shared with every other worker. The test checks the totals; any
//! lost or doubled update shows.

use anyhow::{Context, Result};
use citron_lock::rdma::arith::field_delta;
use citron_lock::rdma::{FabricAddr, Node, RemoteAddr};
use citronfs_tests::TEST_REGION;
use clap::Parser;

/// Word offsets in the test region; the test reads the same ones.
pub const FAA_WORD: u64 = 0;
pub const MASKED_WORD: u64 = 8;
pub const CAS_WORD: u64 = 16;
pub const EXT_WORD: u64 = 32;

#[derive(Parser)]
struct Args {
    /// The fabric to join.
    fabric: String,
    /// Threads, each with its own endpoint.
    threads: usize,
    /// Rounds of verbs per thread.
    iterations: u64,
}

fn main() -> Result<()> {
    let Args { fabric, threads, iterations } = Args::parse();
    let fabric: FabricAddr = fabric.parse().map_err(anyhow::Error::msg)?;
    let node = Node::join(&fabric).context("join fabric")?;
    let addr = |off| RemoteAddr::new(TEST_REGION, off);
    // Two 32-bit fields: the low one counts up, the high one counts down
    // from its initial zero, so it wraps inside its field every time.
    let boundaries = (1u64 << 31) | (1u64 << 63);
    let masked_add = field_delta(0, 32, 1) | field_delta(32, 32, -1);
    let ext_boundaries: u128 = (1u128 << 63) | (1u128 << 127);
    let ext_add: u128 = 1 | (3u128 << 64);

    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let node = node.clone();
                s.spawn(move || -> Result<()> {
                    let ep = node.endpoint()?;
                    for _ in 0..iterations {
                        ep.faa(addr(FAA_WORD), 1)?;
                        ep.masked_faa(addr(MASKED_WORD), masked_add, boundaries)?;
                        let mut cur = ep.read_u64(addr(CAS_WORD))?;
                        loop {
                            let old = ep.cas(addr(CAS_WORD), cur, cur + 1)?;
                            if old == cur {
                                break;
                            }
                            cur = old;
                        }
                        ep.ext_faa(addr(EXT_WORD), ext_add, ext_boundaries)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| anyhow::anyhow!("worker thread panicked"))??;
        }
        Ok(())
    })
}
