//! Generation-loop building blocks that sit between the model's logits and the text a user sees:
//! turning logits into the next token ([`Sampler`]) and cutting the output stream at stop strings
//! without leaking a partial stop string to the client ([`StopMatcher`]).

pub mod sampler;
pub mod stop;

pub use sampler::{Sampler, SamplingParams};
pub use stop::StopMatcher;
