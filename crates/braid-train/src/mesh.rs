//! [`Mesh`]: the world's ranks arranged on named dimensions (data,
//! tensor; replicate and shard for hybrid sharding), groups as pure
//! arithmetic over the ordered sizes (Megatron's rank generator,
//! torchtitan's named mesh): the last dimension varies fastest, so its
//! groups are consecutive ranks — tensor-parallel groups, which carry the
//! most traffic, stay inside a node. A group is one communicator split,
//! passed explicitly to whoever needs it.

use crate::collective::Collective;
use crate::Result;

/// Ranks on named dimensions, outermost first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mesh {
    dims: Vec<(&'static str, usize)>,
    rank: usize,
}

impl Mesh {
    /// `world` ranks on `dims` (their sizes must multiply to `world`),
    /// seen from `rank`.
    pub fn new(world: usize, rank: usize, dims: &[(&'static str, usize)]) -> Result<Mesh> {
        let product: usize = dims.iter().map(|&(_, n)| n).product();
        if dims.iter().any(|&(_, n)| n == 0) || product != world {
            let shown: Vec<String> = dims.iter().map(|(d, n)| format!("{d} {n}")).collect();
            return Err(format!(
                "a mesh of {} is {product} ranks, not the world's {world}",
                shown.join(" x ")
            ));
        }
        if rank >= world {
            return Err(format!("rank {rank} of a world of {world}"));
        }
        Ok(Mesh {
            dims: dims.to_vec(),
            rank,
        })
    }

    fn index(&self, name: &str) -> usize {
        self.dims
            .iter()
            .position(|(d, _)| *d == name)
            .unwrap_or_else(|| panic!("the mesh has no dimension {name:?}"))
    }

    /// Ranks along `name`.
    pub fn size(&self, name: &str) -> usize {
        self.dims[self.index(name)].1
    }

    /// This rank's coordinates, outermost first.
    fn coords_of(&self, rank: usize) -> Vec<usize> {
        let mut rest = rank;
        let mut c = vec![0; self.dims.len()];
        for (i, &(_, n)) in self.dims.iter().enumerate().rev() {
            c[i] = rest % n;
            rest /= n;
        }
        c
    }

    /// This rank's place along `name`.
    pub fn coord(&self, name: &str) -> usize {
        self.coords_of(self.rank)[self.index(name)]
    }

    /// Which group along `name` `rank` is in: its coordinates on the other
    /// dimensions, as one number.
    fn color_of(&self, rank: usize, name: &str) -> usize {
        let skip = self.index(name);
        let c = self.coords_of(rank);
        self.dims
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != skip)
            .fold(0, |acc, (i, &(_, n))| acc * n + c[i])
    }

    /// This rank's group along `name` (its coordinates on the other
    /// dimensions, as one number): the color of a communicator split
    /// whose key is [`coord`](Self::coord).
    pub fn color(&self, name: &str) -> u32 {
        self.color_of(self.rank, name) as u32
    }

    /// The ranks of each group along `name` (for the layout printed at
    /// start), groups in order.
    pub fn groups(&self, name: &str) -> Vec<Vec<usize>> {
        let world: usize = self.dims.iter().map(|&(_, n)| n).product();
        let count = world / self.size(name);
        let mut out = vec![Vec::new(); count];
        for r in 0..world {
            out[self.color_of(r, name)].push(r);
        }
        out
    }

    /// The communicator of this rank's group along `name`: `comm` (the
    /// world's) split, members ordered by their place along it. Every rank
    /// calls it for the same dimensions in the same order.
    pub fn split<C: Collective>(&self, comm: &C, name: &str) -> Result<C> {
        if comm.size() != self.groups(name).iter().map(Vec::len).sum::<usize>() {
            return Err(format!(
                "a mesh of {} ranks over a communicator of {}",
                self.groups(name).iter().map(Vec::len).sum::<usize>(),
                comm.size()
            ));
        }
        let color = self.color_of(self.rank, name) as u32;
        comm.split(color, self.coord(name))
    }

    /// One line: the dimensions and each dimension's groups, e.g. `data 2
    /// x tensor 2; tensor groups [0 1] [2 3]; data groups [0 2] [1 3]`.
    pub fn describe(&self) -> String {
        let dims: Vec<String> = self.dims.iter().map(|(d, n)| format!("{d} {n}")).collect();
        let mut out = dims.join(" x ");
        for &(name, n) in self.dims.iter().rev() {
            if n == 1 {
                continue;
            }
            let groups: Vec<String> = self
                .groups(name)
                .iter()
                .map(|g| {
                    let ranks: Vec<String> = g.iter().map(|r| r.to_string()).collect();
                    format!("[{}]", ranks.join(" "))
                })
                .collect();
            out.push_str(&format!("; {name} groups {}", groups.join(" ")));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_dimension_is_consecutive_ranks() {
        let m = Mesh::new(8, 5, &[("data", 2), ("tensor", 4)]).unwrap();
        assert_eq!((m.coord("data"), m.coord("tensor")), (1, 1));
        assert_eq!(m.groups("tensor"), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
        assert_eq!(
            m.groups("data"),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        assert_eq!(
            m.describe(),
            "data 2 x tensor 4; tensor groups [0 1 2 3] [4 5 6 7]; data groups [0 4] [1 5] [2 6] [3 7]"
        );
        let three = Mesh::new(8, 6, &[("pipeline", 2), ("data", 2), ("tensor", 2)]).unwrap();
        assert_eq!(
            three.groups("data"),
            vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
        );
        assert_eq!(
            (
                three.coord("pipeline"),
                three.coord("data"),
                three.coord("tensor")
            ),
            (1, 1, 0)
        );
        assert!(Mesh::new(6, 0, &[("data", 4), ("tensor", 2)])
            .unwrap_err()
            .contains("not the world's 6"));
    }
}
