//! [`Mesh`]: the world's ranks arranged on named dimensions, groups as
//! pure arithmetic over the ordered sizes (Megatron's rank generator,
//! torchtitan's named mesh): the last dimension varies fastest, so its
//! groups are consecutive ranks — tensor-parallel groups, which carry the
//! most traffic, stay inside a node. A group is one communicator split,
//! passed explicitly to whoever needs it.
//!
//! A training run has one mesh ([`Mesh::training`]): data × pipe ×
//! tensor, the data dimension itself replicate × shard under hybrid
//! sharding (shard groups of consecutive data ranks). Every group a run
//! uses is a view of it: the tensor and pipeline groups, the data group
//! and, for hybrid sharding, the shard groups and their replicas
//! ([`DataGroups`]).

use crate::collective::Collective;
use crate::Result;

/// The degrees of a training run's mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Degrees {
    /// Ranks per tensor group (1: none).
    pub tensor: usize,
    /// Pipeline stages' ranks (1: none).
    pub pipe: usize,
    /// Hybrid sharding: data ranks per shard group (`None`, or all of
    /// them: one group).
    pub shard_group: Option<usize>,
}

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

    /// A training run's mesh of `world` ranks seen from `rank`: data ×
    /// pipe (where there is a pipeline) × tensor, outermost first; under
    /// hybrid sharding (`shard_group` fewer than the data ranks) the data
    /// dimension is replicate × shard, and `"data"` names the two. Degrees
    /// that do not divide the world (or the data ranks) are refused.
    pub fn training(world: usize, rank: usize, d: Degrees) -> Result<Mesh> {
        let model = d.tensor * d.pipe;
        if model == 0 || world % model != 0 {
            return Err(format!(
                "tensor {} x pipeline {} ranks per model do not divide the world's {world}",
                d.tensor, d.pipe
            ));
        }
        let data = world / model;
        let mut dims = match d.shard_group {
            Some(g) if g == 0 || data % g != 0 => {
                return Err(format!(
                    "shard groups of {g} do not divide the {data} ranks (pick a divisor of {data})"
                ))
            }
            Some(g) if g < data => vec![("replicate", data / g), ("shard", g)],
            _ => vec![("data", data)],
        };
        if d.pipe > 1 {
            dims.push(("pipe", d.pipe));
        }
        dims.push(("tensor", d.tensor));
        Mesh::new(world, rank, &dims)
    }

    /// The places in `dims` of the dimensions `name` stands for: its own,
    /// or, for `"data"` in a mesh that splits it, replicate and shard.
    fn indices(&self, name: &str) -> Vec<usize> {
        let at = |n: &str| self.dims.iter().position(|(d, _)| *d == n);
        match (at(name), name, at("replicate"), at("shard")) {
            (Some(i), ..) => vec![i],
            (None, "data", Some(r), Some(s)) => vec![r, s],
            _ => panic!("the mesh has no dimension {name:?}"),
        }
    }

    /// The mesh of this rank's group along `name`: the dimensions `name`
    /// stands for, seen from this rank's place along them (a data group's
    /// replicate × shard, for its hybrid sharding).
    pub fn view(&self, name: &str) -> Mesh {
        Mesh {
            dims: self.indices(name).iter().map(|&i| self.dims[i]).collect(),
            rank: self.coord(name),
        }
    }

    /// Whether the mesh has a dimension `name` of its own.
    pub fn has(&self, name: &str) -> bool {
        self.dims.iter().any(|(d, _)| *d == name)
    }

    /// Ranks along `name`.
    pub fn size(&self, name: &str) -> usize {
        self.indices(name).iter().map(|&i| self.dims[i].1).product()
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

    /// This rank's place along `name` (along replicate × shard for a
    /// split data dimension, the shard varying fastest).
    pub fn coord(&self, name: &str) -> usize {
        let c = self.coords_of(self.rank);
        self.indices(name)
            .into_iter()
            .fold(0, |acc, i| acc * self.dims[i].1 + c[i])
    }

    /// Which group along `name` `rank` is in: its coordinates on the other
    /// dimensions, as one number.
    fn color_of(&self, rank: usize, name: &str) -> usize {
        let skip = self.indices(name);
        let c = self.coords_of(rank);
        self.dims
            .iter()
            .enumerate()
            .filter(|&(i, _)| !skip.contains(&i))
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

/// A rank's data-parallel communicators, views of the run's mesh: every
/// data rank, and under hybrid sharding the rank's shard group and its
/// replicas (the ranks at the same place in the other shard groups).
pub struct DataGroups<C> {
    /// Every rank of the data dimension.
    pub all: C,
    /// Hybrid sharding: (shard group, replicas).
    pub hybrid: Option<(C, C)>,
}

impl<C: Collective> DataGroups<C> {
    /// The groups of `mesh` split from `world`, the world's communicator
    /// (every rank calls it for the same mesh); where the data dimension
    /// is the whole world, `world` itself is its group.
    pub fn split(mesh: &Mesh, world: C) -> Result<DataGroups<C>> {
        let hybrid = match mesh.has("shard") {
            true => Some((
                mesh.split(&world, "shard")?,
                mesh.split(&world, "replicate")?,
            )),
            false => None,
        };
        let all = match mesh.size("data") == world.size() {
            true => world,
            false => mesh.split(&world, "data")?,
        };
        Ok(DataGroups { all, hybrid })
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

    /// A training mesh with hybrid sharding: the data dimension is
    /// replicate × shard, shard groups consecutive data ranks; "data"
    /// still names the two together.
    #[test]
    fn a_training_mesh_splits_its_data_dimension_for_hybrid_sharding() {
        let d = |shard_group| Degrees {
            tensor: 2,
            pipe: 1,
            shard_group,
        };
        // 8 ranks: tensor 2, data 4 in shard groups of 2.
        let m = Mesh::training(8, 6, d(Some(2))).unwrap();
        assert_eq!(
            (m.size("data"), m.size("shard"), m.size("replicate")),
            (4, 2, 2)
        );
        // Rank 6: data rank 3 (shard 1 of replica 1), tensor rank 0.
        assert_eq!(
            (m.coord("data"), m.coord("shard"), m.coord("replicate")),
            (3, 1, 1)
        );
        assert_eq!(m.groups("data"), vec![vec![0, 2, 4, 6], vec![1, 3, 5, 7]]);
        assert_eq!(
            m.groups("shard"),
            vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
        );
        assert_eq!(
            m.groups("replicate"),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        // A data group's own mesh: replicate × shard, rank 6 at data 3.
        assert_eq!(
            m.view("data"),
            Mesh::new(4, 3, &[("replicate", 2), ("shard", 2)]).unwrap()
        );
        // One shard group of all the data ranks: no split dimension.
        let plain = Mesh::training(8, 6, d(Some(4))).unwrap();
        assert!(!plain.has("shard"));
        assert_eq!(plain, Mesh::training(8, 6, d(None)).unwrap());
        assert_eq!(
            plain,
            Mesh::new(8, 6, &[("data", 4), ("tensor", 2)]).unwrap()
        );
        assert!(Mesh::training(8, 0, d(Some(3)))
            .unwrap_err()
            .contains("shard groups of 3 do not divide the 4 ranks"));
    }
}
