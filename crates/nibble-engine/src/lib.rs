//! Generation on top of a model and a backend: turning logits into the next token
//! ([`Sampler`]), cutting the output stream at stop strings without leaking a partial stop string
//! ([`StopMatcher`]), the generation loop ([`Engine::generate`]) and perplexity.

pub mod block_manager;
pub mod eval;
pub mod generate;
pub mod sampler;
pub mod serving;
pub mod stop;
pub mod structured;

pub use generate::{Engine, FinishReason, GenerateOutput, GenerateRequest};
pub use sampler::{Sampler, SamplingParams};
pub use stop::StopMatcher;
